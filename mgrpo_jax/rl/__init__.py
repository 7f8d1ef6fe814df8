"""The RL run: `build_system` assembles the parts, `Trainer` runs warm start, RL steps and hooks; the sides
(`sides.py`) collect, credit and update; the exchange moves a step's data between the sides (in this process or,
in the decoupled mode, through the shared store); unsync, warm start, curriculum and evaluation beside them."""
