"""The OpenAI API on Ray Serve: `import_path: raylm.cluster.serve.app:build_app` (app.py), the replica class and its
handles, the ingresses and routers, prefill/decode disaggregation (serve_pd.py), LoRA ingress, Ray metrics."""
