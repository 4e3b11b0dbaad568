"""What one process asks the kernel about others: dying with its parent (:mod:`.lifeline`), and whether a process
named by its PID still lives (:mod:`.pids`).

Beneath every wing that starts or tracks processes (the fleet, the engine's rank group, the server, the commands),
and importing nothing of the project, so that each of them reaches it without reaching into another.
"""
