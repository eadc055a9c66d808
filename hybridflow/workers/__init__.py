"""Workers: engines exposed as @register'ed primitive APIs that the driver calls on whole groups."""
