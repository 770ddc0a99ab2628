"""`fastspec tune`: choose (num_steps, topk, num_draft_tokens) per batch size from replayed acceptance and
measured round costs, confirm the best end to end, and write a tuned file the engine loads."""
