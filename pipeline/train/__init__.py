"""Training machinery: Ray Train driver, per-rank loop and its config, runner contexts, checkpoints,
optimiser, techniques. The pretrain / finetune stages that use it are ``pipeline/training.py``."""
