"""What the gateway says about itself: metrics, traces, logs."""
