"""What every floor above shares: the step contract (SchedulerOutput, ModelRunnerOutput, IntermediateTensors),
sampling parameters, the parallel layout, the step timeline and the log set-up. It imports only `raylm.configs`."""
