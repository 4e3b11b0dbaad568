"""Starting and keeping processes: the local fleet that ``run`` starts, its supervisor, the launcher its engines are
forked from, and the argument vectors they are started with. Its children die with it by the lifeline
(:mod:`megatron_serve.processes.lifeline`).
"""
