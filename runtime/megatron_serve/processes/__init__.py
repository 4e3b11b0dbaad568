"""What one process asks the kernel about itself and others: dying with its parent (:mod:`.lifeline`), whether a
process named by its PID still lives (:mod:`.pids`), and which device it computes on (:mod:`.devices`: GPU driver
nodes, torch's build).

Beneath every wing that starts or tracks processes (the fleet, the engine's rank group, the server, the commands)
and the configuration, and importing nothing of the project, so that each of them reaches it without reaching into
another.
"""
