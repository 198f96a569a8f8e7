"""Training: the pretrain / finetune stages (:mod:`.stage`) and the machinery they drive: Ray Train
driver, per-rank loop and its config, runner contexts, checkpoints, optimiser, techniques."""
