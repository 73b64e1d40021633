"""servelm's router: an OpenAI-API front over several servers (`servelm router`).

config.py (RouterConfig, the flags), cli.py (parsing; `serve --run_mode pd_master`), app.py (the
HTTP routes and health checks), proxy.py (data-parallel forwarding and retries), pd.py (SGLang's
prefill/decode protocol), policies.py and prefix_tree.py (picking a worker), workers.py (worker
state), errors.py (OpenAI-shaped errors). It talks to workers over HTTP only, so it imports no
engine code.
"""
