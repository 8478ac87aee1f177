"""Settling a running attempt as Awa's worker does: re-schedules and endings, on both planes.

``api`` holds the public calls, ``running`` where a handler's attempt comes from, ``flow`` the
steps of a call, ``statements`` the pure builders they run.
"""
