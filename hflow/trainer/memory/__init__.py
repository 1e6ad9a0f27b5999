"""The memory plan: peak device memory per phase and rank, before launch (`plan` adds it up; `facts` reads the
model, the settings and the traces; `trace` runs each pass on fake tensors). `python -m hflow.cli.memory_plan`
prints it; preflight applies it (`trainer.memory_plan`)."""
