"""The OpenAI API on Ray Serve: `import_path: raylm.cluster.serve.app:build_app` (app.py), the replica class and its
handles, the ingresses and routers, prefill/decode disaggregation (serve_pd.py), a fleet of
models behind one ingress (fleet.py), LoRA multiplexing and adapters loaded at run time, Ray metrics."""
