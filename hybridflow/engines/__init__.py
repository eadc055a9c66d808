"""Training engine (FSDP2), rollout engines and weight sync: the compute under the workers."""
