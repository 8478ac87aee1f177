"""The execution core every capability runs on, and the only place any of them share code.

Bind forms, input checks shared by every verb, statements compiled once and run as text, the
supported drivers, the statement registry and its SQL pieces, error translation, and
SQLAlchemy's private names (``internals``). Nothing here imports a capability.
"""
