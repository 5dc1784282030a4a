"""What a run writes: output.dir and its metrics.jsonl (directory), the sinks its records go to and
the trackers among them, the curves drawn from them, and the exported model at the end."""
