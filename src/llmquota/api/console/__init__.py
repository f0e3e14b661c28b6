"""The web console at /console: server-rendered HTML for an admin, no JavaScript.

pages.py holds the routes, session.py the cookies and CSRF tokens, views.py
and html.py the HTML, chart.py the inline SVG chart.
"""

from llmquota.api.console.pages import install_console

__all__ = ["install_console"]
