"""Starting and keeping processes: the local fleet that ``run`` starts, its supervisor, the lifeline
that takes children down with their parent, and the argument vectors they are started with.
"""
