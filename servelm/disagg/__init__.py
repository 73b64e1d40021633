"""Prefill/decode disaggregation: K/V blocks move from a prefill server's engine to a decode
server's engine (``--disaggregation-mode``).

- ``spec.py``: what a request says about its transfer (SGLang's bootstrap fields, vLLM's
  kv_transfer_params), parsed by the front end and carried to the engine.
- ``transfer.py``: the wire messages and the page-wise copy of blocks out of and into a KV pool.
- ``transport.py``: how the bytes cross (--disaggregation-transfer-backend): the Sender/Receiver
  interface, zmq and shm; ``nixl_transport.py`` and ``mooncake_transport.py``: one-sided writes
  into the decode pool.
- ``prefill.py``: the prefill side, in the engine process: the bootstrap endpoint (a pyzmq ROUTER
  on --disaggregation-bootstrap-port), the finished requests' parked blocks, the pulls.
- ``decode.py``: the decode side, in the engine process: reserve blocks, pull, write, hand the
  request to the scheduler with its first token.
- ``register.py``: LightLLM's registration with a PD master (`servelm router`).
"""
