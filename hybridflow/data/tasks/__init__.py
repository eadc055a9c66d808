"""Built-in tasks: generators that write prompt files in veRL's schema."""
