"""`polar dashboard`: a read-only local web page over a store, a rollout's report directory or a loop's directory."""
