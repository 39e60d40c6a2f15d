"""The demo: the main job on the embedded default, and its simulated editor users."""
