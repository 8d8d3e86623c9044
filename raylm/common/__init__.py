"""What every floor above shares: the step contract (SchedulerOutput, ModelRunnerOutput, IntermediateTensors, the KV
connectors' metadata), a request's parameters (sampling, pooling, structured outputs, LoRA), the parallel layout, the
step timeline, the log set-up and checkpoints in object storage. Of raylm it imports only `raylm.configs`."""
