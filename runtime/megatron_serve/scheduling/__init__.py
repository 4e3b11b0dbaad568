"""Scheduling rules shared by the coordinator and the engines: which waiting request goes first (:mod:`.queue_policy`).
It sits beneath both wings and imports only the wire's vocabulary."""
