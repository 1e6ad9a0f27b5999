"""Built-in tasks: the data, the reward they are scored by and the small pre-trained models that make RL on
them possible on a CPU in minutes (the arithmetic task of `main_ppo`'s default, the RLHF pipeline's task).
Helpers shared by the whole framework live in `hflow.utils`; only tasks and their model builders live here."""
