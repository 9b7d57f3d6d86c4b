"""The process: how it was launched and joined the group, and how a failure is reported once."""
