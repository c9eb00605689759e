"""Reinforcement learning on det_lab: a Core API supervisor for rsl_rl / Isaac Lab training
commands (:mod:`det_lab.rl.supervisor`), readers for their output (:mod:`det_lab.rl.log_parsers`,
:mod:`det_lab.rl.tfevents`), det_lab's rsl_rl LogWriter (:mod:`det_lab.rl.rsl_writer`) and a CPU
stand-in task (:mod:`det_lab.rl.standin`)."""
