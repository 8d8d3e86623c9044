"""Batch inference on Ray Data: a processor mapping a Dataset of prompts through a pool of engine replicas
(processor.py), and the OpenAI Batch file format (`raylm run-batch`, run_batch.py). The public face is `raylm.data`;
nothing is imported here, so that the CLI reads its flags without loading Ray Data."""
