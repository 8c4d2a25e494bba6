"""What systemd and operators see: health and metrics, sd_notify, process figures, the unit."""
