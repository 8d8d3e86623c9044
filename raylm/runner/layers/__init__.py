"""Parallel building blocks of the models: linear, embedding, norm, rotary, activation, attention."""
