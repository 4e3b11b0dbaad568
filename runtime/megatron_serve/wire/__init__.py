"""What crosses a process boundary: messages, the frame protocol, the request and its sampling
parameters, the lifecycle's rules, the secured connection and the stats that engines publish.

Everything here is torch-free, so the coordinator, the HTTP server and ``control`` import it cheaply.
"""
