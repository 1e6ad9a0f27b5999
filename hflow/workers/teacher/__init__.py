"""The teacher: a frozen causal LM that scores the tokens the student sampled (on-policy distillation)."""
