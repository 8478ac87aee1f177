"""The read capability: jobs read in the caller's transaction, and jobs as a selectable."""
