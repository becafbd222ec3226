"""`python -m framework.planner`: the meshes, DP strategies and schedules a model can run on N
ranks, each checked by the launcher's validation, sized and timed by the dry run (which it calls;
nothing below it imports it), and ranked by predicted step time.

candidates.py enumerates; cost.py predicts memory and time from a dry-run report; calibrate.py
measures this host's matmul rate and collective latency and bandwidth; profiles.yaml holds
published figures for GPUs, so a plan for a cluster can be made on a laptop.
"""
