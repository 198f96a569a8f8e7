"""Training: Ray Train driver, per-worker loop, optimiser, and the pretrain/finetune stages."""
