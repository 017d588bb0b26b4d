"""What the daemon and its clients share: the control protocol, the options, the mount table."""
