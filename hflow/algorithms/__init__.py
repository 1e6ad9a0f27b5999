"""The RL math, pure torch: advantage estimators, policy/value/entropy losses, KL estimators and
controllers. It sits below the workers and the trainer (both import it) and imports neither."""
