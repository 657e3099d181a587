package idempotency

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"net/http"
	"strings"
	"sync"

	"google.golang.org/grpc/codes"
)

// downstream is what a running call's downstream keys derive from, and
// the counters of the keys CountedKey hands out. It lives in the call's
// transaction (callTx), so that a call that derives no key allocates
// nothing for it.
type downstream struct {
	mu sync.Mutex
	// base hashes what tells this operation from every other one (see
	// downstreamBase); zero until the first key is derived.
	base    [sha256.Size]byte
	hasBase bool
	n       map[string]uint64 // counted keys handed out, per target
}

// Prefixes of derived keys, so that an operator reading a key table can
// tell one from a client's key; they name the key's format: versions 2
// and 3 of the derivation share one (they differ only in what an HTTP
// request's base holds, see derivationInput).
const (
	derivedKeyPrefixV1 = "dk1-"
	derivedKeyPrefix   = "dk2-"
)

// derivedKeySum is how many bytes of the hash a version 2 key carries:
// 240 bits, 40 characters of base64, 44 with the prefix, within the
// shortest limit a payment provider sets that we know of (Square's 45).
const derivedKeySum = 30

// ErrCallEnded is returned for an outgoing call made with the context of
// an idempotent call that has ended: a goroutine the handler left running,
// or a context kept past the handler's return. The call's keys can no
// longer be derived (the key the call stood for may already have a stored
// result, or run again elsewhere), so nothing is sent. Use a context of
// the handler's own making for work that outlives the call, with a key of
// its own ([WithOutgoingKey]).
var ErrCallEnded = &Error{code: codes.Internal, reason: "CALL_ENDED",
	msg: "an outgoing call was made with the context of an idempotent call that has ended; derive its key while the handler runs, or give it a key of its own"}

// ErrUnnamedEffect is returned for an outgoing call that needs a key (a
// POST or PATCH over HTTP, a gRPC method that protobuf does not mark
// NO_SIDE_EFFECTS or IDEMPOTENT) made inside a running call with neither a
// key of its own nor a name: nothing is sent. A key counted by call order
// would not keep it one operation: the count changes when a run makes its
// calls in another order, makes one only on some runs, or retries one
// with a new request, and the provider then charges twice. Name the
// effect with [WithEffect] (one name per effect, the same on every run and
// every retry of it), or set its key with [WithOutgoingKey]; over HTTP,
// [HTTPClient] retries a request under the one key it chose. It is a
// configuration error of the handler: retrying cannot help.
var ErrUnnamedEffect = &Error{code: codes.Internal, reason: "UNNAMED_EFFECT",
	msg: "an outgoing call inside an idempotent call has neither a key nor a name; " +
		"name its effect with idempotency.WithEffect(ctx, name), the same name on every run and every retry of it, " +
		"or set its key with idempotency.WithOutgoingKey"}

// EffectKey returns the key of the downstream effect named name of the
// call running in ctx, and false when no call runs in ctx (or it has
// ended). The same name gives the same key, however many times and in
// whatever order the handler asks, on every run of the same operation:
// name each effect after what it does, such as "charge " + orderID or
// "POST /v1/refunds " + itemID, and keep one name for one effect, its
// retries included. Calls made with a context from [WithEffect] send this
// key.
//
// Like every derived key, it depends on the operation the running call
// is, and on nothing the handler does: not on which other effects ran,
// nor on their order, nor on the build that runs it. The operation is the
// call's scope and key with its transport (a gRPC call, an HTTP request
// and a message with the same key derive different keys), its method, the
// store (its table as configured, and [WithDerivedKeyNamespace]) and its
// request as the request comparison sees it: of a proto request, a digest
// of its encoding written as the comparison reads it (-0 as 0, a field set
// to its default as unset) that does not depend on the schema the binary
// links in, so that a deploy between a crash and its re-run keeps the keys
// (its unknown fields count, though the comparison cannot read them); of
// an HTTP request, its method, target, host and Content-Type with its
// form, or without one its body, by value for JSON (see [HTTPMiddleware]);
// of a message, its body. Two operations that differ in any of them, such
// as a corrected request sent again under a key that was released, derive
// different keys; a re-run of the same request derives the same ones, also
// when it is written another way that the comparison calls the same (JSON
// members in another order, a form parsed in front on one attempt only).
// One exception: two bodies of one form ("a+b" and "a%20b") are two
// requests to the comparison but derive one form's keys, as each is the
// same request as that form parsed in front.
// The key is "dk2-" and 40 characters of URL-safe base64 of a SHA-256 of
// all that: 44 printable ASCII characters that contain neither the scope
// nor the key. The hash has no secret: whoever can guess all of its inputs
// can confirm the guess, so do not rely on derived keys to hide guessable
// ones. A parent key used again for the same request after its record
// expired derives the same keys as before: a client must never reuse a key
// for another operation.
func EffectKey(ctx context.Context, name string) (string, bool) {
	t, ok := liveCall(ctx)
	if !ok {
		return "", false
	}
	return t.effectKey(name), true
}

// WithEffect returns ctx naming the downstream effect of the calls made
// with it: inside a running call, [UnaryClientInterceptor], [HTTPTransport]
// and [HTTPClient] send the key [EffectKey] gives for name, unless the call
// carries a key of its own; a call that needs a key and has neither is
// refused with [ErrUnnamedEffect]. A call made only on some runs, calls
// made concurrently, and a call the handler retries itself, with the same
// request or a new one, keep their keys this way. Outside a running call
// it changes nothing. An empty name is ignored.
func WithEffect(ctx context.Context, name string) context.Context {
	return context.WithValue(ctx, effectName{}, name)
}

type effectName struct{}

// CountedKey returns the key counted for the next call to target of the
// call running in ctx, and false when no call runs in ctx (or it has
// ended): each call of CountedKey returns the next ordinal's key (0, 1,
// ... per target), derived from the operation as [EffectKey]'s are.
//
// Use with care: the key depends on how many times the run asked before,
// so a re-run gets the first run's key only if it asks in the same order.
// A call made only on some runs, concurrent calls, or a retry that asks
// again shift the ordinals, and a re-run then sends a key under which the
// first run asked for something else: the provider charges twice. Name
// effects instead ([WithEffect], [EffectKey]).
//
// It is here for calls whose first run, under a release before
// [ErrUnnamedEffect], got a counted key without asking (the client
// interceptor, [HTTPTransport] and [HTTPClient] counted the calls nobody
// named; they now refuse them): until no such call can run again, send
// those calls with WithOutgoingKey(ctx, key) of the key CountedKey gives
// for the target they counted, in the order they made them: the gRPC
// method's full name, or "METHOD path" over HTTP (the URL's escaped path,
// without host or query).
func CountedKey(ctx context.Context, target string) (string, bool) {
	t, ok := liveCall(ctx)
	if !ok {
		return "", false
	}
	return t.countedKey(target), true
}

// liveCall is the call running in ctx, while its handler runs.
func liveCall(ctx context.Context) (*callTx, bool) {
	t, ok := callFrom(ctx)
	if !ok || t.ended() {
		return nil, false
	}
	return t, true
}

// derivedOutgoingKey is the key of an outgoing call to target made with
// ctx that needs a key and carries none of its own, and whether ctx is
// inside a running call: there, the key of the effect WithEffect names,
// and for a call nobody named ErrUnnamedEffect, whose message ends with
// fix, what the caller's protocol offers besides. Outside, none. A call
// that has ended is ErrCallEnded.
func derivedOutgoingKey(ctx context.Context, target, fix string) (key string, inCall bool, err error) {
	t, ok := callFrom(ctx)
	switch {
	case !ok:
		return "", false, nil
	case t.ended():
		return "", true, ErrCallEnded.with(target, nil)
	}
	name, _ := ctx.Value(effectName{}).(string)
	if name == "" {
		// Not a key counted by call order: a re-run or a retry that makes
		// its calls otherwise would send one key for two operations.
		return "", true, ErrUnnamedEffect.with(target+fix, nil)
	}
	return t.effectKey(name), true, nil
}

func (t *callTx) effectKey(name string) string {
	// Whatever the version: version 1 had no names, so no key of a name
	// was ever sent another way.
	d := &t.downstream
	d.mu.Lock()
	base := d.baseLocked(t.attempt)
	d.mu.Unlock()
	return deriveKey(base, 'n', name, 0)
}

func (t *callTx) countedKey(target string) string {
	d := &t.downstream
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.n == nil {
		d.n = make(map[string]uint64)
	}
	n := d.n[target]
	d.n[target] = n + 1
	if t.attempt.s.opts.derivedKeyVersion == 1 {
		return deriveKeyV1(t.attempt.call.Scope, t.attempt.key, target, n)
	}
	return deriveKey(d.baseLocked(t.attempt), 'c', target, n)
}

// baseLocked is the hash every key of the running call derives from:
// version, store, scope, the key as stored, method and request (as the
// request comparison sees it: see derivationInput), each length-prefixed
// so that no two different tuples hash the same bytes.
func (d *downstream) baseLocked(a *attempt) [sha256.Size]byte {
	if d.hasBase {
		return d.base
	}
	h := sha256.New()
	var b [binary.MaxVarintLen64]byte
	o := &a.s.opts
	req := a.tp.digest
	if !a.tp.hasDigest {
		req = sha256.Sum256(derivationInput(a.call.Fingerprint, o.derivedKeyVersion))
	}
	for _, s := range []string{"idempotency downstream key v2", o.derivedKeyNamespace, o.schema, o.table, a.call.Scope, a.key, a.call.Method, string(req[:])} {
		h.Write(b[:binary.PutUvarint(b[:], uint64(len(s)))])
		h.Write([]byte(s))
	}
	h.Sum(d.base[:0])
	d.hasBase = true
	return d.base
}

// deriveKey hashes base, the kind of the key ('n' named, 'c' counted), its
// name or target, and for a counted key its ordinal.
func deriveKey(base [sha256.Size]byte, kind byte, name string, n uint64) string {
	h := sha256.New()
	var b [binary.MaxVarintLen64]byte
	h.Write(base[:])
	h.Write([]byte{kind})
	h.Write(b[:binary.PutUvarint(b[:], uint64(len(name)))])
	h.Write([]byte(name))
	h.Write(b[:binary.PutUvarint(b[:], n)])
	var sum [sha256.Size]byte
	return derivedKeyPrefix + base64.RawURLEncoding.EncodeToString(h.Sum(sum[:0])[:derivedKeySum])
}

// deriveKeyV1 is the first derivation (WithDerivedKeyVersion(1)): scope,
// key with its transport, target and ordinal; 47 characters.
func deriveKeyV1(scope, key, target string, n uint64) string {
	h := sha256.New()
	var b [binary.MaxVarintLen64]byte
	for _, s := range []string{"idempotency downstream key v1", scope, key, target} {
		h.Write(b[:binary.PutUvarint(b[:], uint64(len(s)))])
		h.Write([]byte(s))
	}
	h.Write(b[:binary.PutUvarint(b[:], n)])
	var sum [sha256.Size]byte
	return derivedKeyPrefixV1 + base64.RawURLEncoding.EncodeToString(h.Sum(sum[:0]))
}

// HTTPTransport is an [http.RoundTripper] that sets the [HeaderKey] header on
// outgoing POST and PATCH requests (the methods the IETF draft names as not
// idempotent) that carry none, for servers that honour it: payment
// providers such as Stripe and Adyen, and [HTTPMiddleware]. The key is, in
// order: the request's own header, the key of [WithOutgoingKey] in the
// request's context, or, when the request's context is inside a running
// call, the key of the effect [WithEffect] names. Inside a running call, a
// POST or PATCH with none of them is refused with [ErrUnnamedEffect],
// nothing sent. Any other request is sent as it is: outside a running
// call, nothing would make a generated key the same on a retry
// ([HTTPClient] keeps one across its own retries).
//
//	client := &http.Client{Transport: &idempotency.HTTPTransport{}}
//	req, _ := http.NewRequestWithContext(idempotency.WithEffect(ctx, "charge "+orderID), "POST", providerURL+"/v1/charges", body)
//	resp, err := client.Do(req) // ctx is the handler's: the key is derived
//
// Every request made with a context that names the effect (or sets the
// key), a retry that builds a new request or resends this one included,
// carries the same key, on every run of the call. A redirect that keeps the method (307, 308) carries the key of the
// request it follows. A request made with the context of a call that has
// ended is refused with [ErrCallEnded], nothing sent.
type HTTPTransport struct {
	// Base sends the requests; nil means [http.DefaultTransport].
	Base http.RoundTripper
	// RecordEffects makes a request whose key is derived from the effect
	// its context names ([WithEffect]) a recorded step (see [Step]): a
	// response that no other attempt can change (2xx, 4xx but 408, 409,
	// 425 and 429) is recorded, its status, headers and body, under the
	// running call and the name, and a re-run of the running call gets a
	// copy of it without sending the request, even when the server has
	// forgotten the key. A redirect, an error and any other status are
	// returned unrecorded. Each recorded request costs a lookup and a
	// commit on another connection of the running call's store.
	RecordEffects bool
}

// RoundTrip implements [http.RoundTripper]. It does not modify req: a
// request that gets a key is sent as a shallow copy with its own header.
// An invalid key from [WithOutgoingKey] is an error of [ErrInvalidKey], an
// unnamed POST or PATCH inside a running call one of [ErrUnnamedEffect]:
// nothing is sent. The response's Request is the copy sent, with the key,
// also when Base answers without one.
func (t *HTTPTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	if t.RecordEffects {
		if resp, recorded, err := httpStep(req, t.roundTrip); recorded {
			return resp, err
		}
	}
	return t.roundTrip(req)
}

func (t *HTTPTransport) roundTrip(req *http.Request) (*http.Response, error) {
	base := t.Base
	if base == nil {
		base = http.DefaultTransport
	}
	if !keyedMethod(req.Method) || req.Header.Get(HeaderKey) != "" {
		return base.RoundTrip(req)
	}
	key, ok, err := httpRequestKey(req)
	if err != nil {
		closeBody(req)
		return nil, err
	}
	if !ok {
		return base.RoundTrip(req)
	}
	r := req.Clone(req.Context())
	if r.Header == nil { // a request built by hand; http.Client always sets one
		r.Header = make(http.Header)
	}
	r.Header.Set(HeaderKey, headerValue(key))
	resp, err := base.RoundTrip(r)
	if resp != nil && resp.Request == nil {
		// http.Client builds a redirect's request on this response's
		// Request: without it, the redirect would not find the key it
		// follows.
		resp.Request = r
	}
	return resp, err
}

// keyedMethod reports whether requests of method get a key: POST and
// PATCH, the methods the IETF draft names as not idempotent.
func keyedMethod(method string) bool {
	return method == http.MethodPost || method == http.MethodPatch
}

// httpRequestKey is the key HTTPTransport and HTTPClient give req, a POST
// or PATCH which carries no header of its own, and false for none:
// WithOutgoingKey's, the key of the request a redirect follows, or inside
// a running call the key of the effect WithEffect names (an unnamed
// request there is ErrUnnamedEffect).
func httpRequestKey(req *http.Request) (string, bool, error) {
	ctx := req.Context()
	if key, ok := ctx.Value(outgoingKey{}).(string); ok {
		if err := ValidateKey(key); err != nil {
			return "", false, keyError(err, HeaderKey, "WithOutgoingKey")
		}
		return key, true, nil
	}
	t, inCall := callFrom(ctx)
	if inCall && t.ended() {
		// Whatever the key would be (a redirect's too), it was derived for
		// a call that is over.
		return "", false, ErrCallEnded.with(req.Method+" "+req.URL.EscapedPath(), nil)
	}
	if key, ok := redirectedKey(req); ok {
		// The key of the request the call made: a redirect is no call of
		// its own.
		return key, true, nil
	}
	key, derived, err := derivedOutgoingKey(ctx, req.Method+" "+req.URL.EscapedPath(),
		" (every request made with that context carries its key, a retry with a new request too; "+
			"idempotency.HTTPClient retries a request under one key)")
	return key, derived && err == nil, err
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
