"""An app that knows nothing of herdguard: plain GETs to service addresses,
no proxy settings. The second names its service by a name only the app
knows (as one resolved by the app's own DNS would be): only the address
connected to tells where it goes. Prints one line per call: status,
x-herdguard-attempts, body."""
import urllib.error
import urllib.request

opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
calls = (
    ("http://127.0.0.2:8080/flaky", {}),
    ("http://127.0.0.3:8080/other", {"Host": "other.internal:8080"}),
)
for url, headers in calls:
    try:
        with opener.open(urllib.request.Request(url, headers=headers), timeout=10) as resp:
            status, headers, body = resp.status, resp.headers, resp.read().decode()
    except urllib.error.HTTPError as e:
        status, headers, body = e.code, e.headers, e.read().decode()
    print(f"{url} status={status} attempts={headers.get('x-herdguard-attempts', '-')} {body}", flush=True)
