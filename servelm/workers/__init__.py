"""Rank workers and the executors that drive them (above model/, below engine/).

A worker owns one rank's shard of the weights and its KV cache and executes the plans it is sent;
an executor presents a group of them to the engine as one ``Runner``.
"""
