"""Speculative decoding: proposers that guess a request's next tokens, and the engine verifies them.

A proposer (:class:`~.proposer.Proposer`) only guesses; the engine schedules the guesses as extra
query rows of the target's forward, keeps the longest accepted prefix (greedy: equal to the
target's argmax; sampled: rejection sampling) plus one token of its own, and rolls back the KV of
rejected rows. Whatever a proposer returns, the output is the target's.
"""
