"""The research lab: workloads, a calibrated step-time model, a simulator that drives the real
pure scheduler against it, the real online replay it is judged by, a tuner, and plots."""
