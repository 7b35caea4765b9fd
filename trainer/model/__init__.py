"""The model being trained and the engine it runs on: device, precision, FSDP2 sharding and the
LR schedule (``training_engine``), the policy (model, tokenizer, optimizer, one step), LoRA,
per-rank sharded loading, Hugging Face export, weight publishing to the rollout servers, and
this process's place in a multi-rank job.
"""
