package idempotency

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"net/http"
	"strings"
	"sync"
)

// downstreamCalls counts a running call's downstream calls per target.
type downstreamCalls struct {
	mu sync.Mutex
	n  map[string]uint64
}

func (d *downstreamCalls) next(target string) uint64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.n == nil {
		d.n = make(map[string]uint64)
	}
	n := d.n[target]
	d.n[target] = n + 1
	return n
}

// derivedKeyPrefix starts every derived key, so that an operator reading a
// key table can tell one from a client's key; it names the derivation's
// version.
const derivedKeyPrefix = "dk1-"

// DownstreamKey returns the key for the next call the call running in ctx
// makes to target, and false when no call runs in ctx. target names what
// is called, the same way on every run: a gRPC method, "POST /v1/charges",
// or a name of the handler's choosing such as "refund item-7". Each call
// returns the next ordinal's key: call it once per downstream call, and
// keep the key for that call's retries.
//
// The key is the URL-safe base64 of a SHA-256 of the running call's scope,
// key (with its transport: a gRPC call, an HTTP request and a message with
// the same key derive different keys), target and ordinal, after the
// prefix "dk1-": 47 printable ASCII characters that contain neither the
// scope nor the key. The hash has no secret: whoever can guess a parent key
// (an order number) can confirm the guess by hashing it, so do not rely on
// derived keys to hide guessable ones. A parent key used again for a new
// operation after its record expired derives the same keys as before, and
// a downstream system that still remembers them answers with the old
// results: a client must never reuse a key for another operation. The interceptors
// and [HTTPTransport] call it for outgoing calls that have no key of their own.
func DownstreamKey(ctx context.Context, target string) (string, bool) {
	t, ok := callFrom(ctx)
	if !ok {
		return "", false
	}
	return deriveKey(t.attempt.call.Scope, t.attempt.key, target, t.downstream.next(target)), true
}

// deriveKey hashes its inputs, each length-prefixed so that no two
// different tuples hash the same bytes.
func deriveKey(scope, key, target string, n uint64) string {
	h := sha256.New()
	var b [binary.MaxVarintLen64]byte
	for _, s := range []string{"idempotency downstream key v1", scope, key, target} {
		h.Write(b[:binary.PutUvarint(b[:], uint64(len(s)))])
		h.Write([]byte(s))
	}
	h.Write(b[:binary.PutUvarint(b[:], n)])
	var sum [sha256.Size]byte
	return derivedKeyPrefix + base64.RawURLEncoding.EncodeToString(h.Sum(sum[:0]))
}

// HTTPTransport is an [http.RoundTripper] that sets the [HeaderKey] header on
// outgoing POST and PATCH requests (the methods the IETF draft names as not
// idempotent) that carry none, for servers that honour it: payment
// providers such as Stripe and Adyen, and [HTTPMiddleware]. The key is, in
// order: the request's own header, the key of [WithOutgoingKey] in the
// request's context, or, when the request's context is inside a running
// call, the key [DownstreamKey] derives for the target "METHOD path" (the
// URL's path without host or query, so that a re-run that reaches another
// host of the same service sends the same key). Any other request is sent
// as it is: outside a running call, nothing would make a generated key the
// same on a retry.
//
//	client := &http.Client{Transport: &idempotency.HTTPTransport{}}
//	req, _ := http.NewRequestWithContext(ctx, "POST", providerURL+"/v1/charges", body)
//	resp, err := client.Do(req) // ctx is the handler's: the key is derived
//
// A redirect that keeps the method (307, 308) carries the key of the
// request it follows, so a re-run that is not redirected sends the same
// keys.
//
// A request that is retried above the transport (a retrying HTTP client
// calls RoundTrip once per attempt) needs its key set before the first
// attempt, in the header or with [WithOutgoingKey]; otherwise each attempt
// counts as the next call.
type HTTPTransport struct {
	// Base sends the requests; nil means [http.DefaultTransport].
	Base http.RoundTripper
}

// RoundTrip implements [http.RoundTripper]. It does not modify req: a
// request that gets a key is sent as a shallow copy with its own header.
// An invalid key from [WithOutgoingKey] is an error of [ErrInvalidKey] and
// nothing is sent.
func (t *HTTPTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	base := t.Base
	if base == nil {
		base = http.DefaultTransport
	}
	if (req.Method != http.MethodPost && req.Method != http.MethodPatch) || req.Header.Get(HeaderKey) != "" {
		return base.RoundTrip(req)
	}
	ctx := req.Context()
	key, ok := ctx.Value(outgoingKey{}).(string)
	if ok {
		if err := ValidateKey(key); err != nil {
			closeBody(req)
			return nil, keyError(err, HeaderKey, "WithOutgoingKey")
		}
	} else if key, ok = redirectedKey(req); ok {
		// The key of the request the call made: a redirect is no call of
		// its own, and must not take the next ordinal.
	} else if key, ok = DownstreamKey(ctx, req.Method+" "+req.URL.EscapedPath()); !ok {
		return base.RoundTrip(req)
	}
	r := req.Clone(ctx)
	if r.Header == nil { // a request built by hand; http.Client always sets one
		r.Header = make(http.Header)
	}
	r.Header.Set(HeaderKey, headerValue(key))
	return base.RoundTrip(r)
}

// redirectedKey is the key the transport sent with the request that req
// follows as a redirect (http.Client builds a new request for each hop,
// with the headers of the first and without the key set on its copy).
func redirectedKey(req *http.Request) (string, bool) {
	if req.Response == nil || req.Response.Request == nil {
		return "", false
	}
	key, err := keyFromHeader(req.Response.Request.Header)
	return key, err == nil && key != ""
}

// headerValue is key as most servers read it, a bare token, unless it
// starts with a quote: then it is a structured-field string, as the IETF
// draft writes every key.
func headerValue(key string) string {
	if !strings.HasPrefix(key, `"`) {
		return key
	}
	return `"` + strings.NewReplacer(`\`, `\\`, `"`, `\"`).Replace(key) + `"`
}

// closeBody closes a request's body that will not be sent, as a
// RoundTripper must.
func closeBody(req *http.Request) {
	if req.Body != nil {
		_ = req.Body.Close()
	}
}
