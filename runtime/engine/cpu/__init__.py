"""The CPU path (what a function without a GPU, e.g. on AWS Lambda, runs): attention without masks, projections
of decode steps over packed weights, and torch's threads from the cgroup's CPU quota (docs/engine.md)."""
