"""Around the engine, not in it: the draft-checkpoint cutter and the `raylm bench serve` client."""
