"""The read capability's statement builders' package."""
