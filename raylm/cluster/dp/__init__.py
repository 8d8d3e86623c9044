"""Data parallel: N engines as Ray actors (engine_core_actor), the client that spreads requests over them (dp_client)
and the load balancer and prefix-aware router it picks an engine with."""
