"""`fastspec train-draft`: train an EAGLE-3 head for a target, the job SpecForge does for SGLang.

data.py regenerates responses with the target and extracts its features; ttt.py is the training-time-test
objective; trainer.py owns the loop, checkpoints and the exported SGLang/SpecForge-format head.
"""
