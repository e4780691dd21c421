"""The admin web console at /admin/ui: server-rendered pages over the admin API.

    session.py  sign-in with the admin key, the session cookie and CSRF tokens
    pages.py    templates, security headers (CSP), forms and error pages
    views.py    what each page shows, read from the live core
    traffic.py  live traffic figures out of the gateway's own /metrics text
    routes.py   the routes and the actions (which call gateway/admin/api.py and gateway/admin/reload.py)

The console is on whenever the admin API is (`admin.key_env` names a set variable) and answers 403
otherwise. Templates and the one script live beside this file; nothing is built.
"""
