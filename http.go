package idempotency

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"math"
	"net"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

// HeaderKey is the HTTP request header carrying the idempotency key
// (draft-ietf-httpapi-idempotency-key-header).
const HeaderKey = "Idempotency-Key"

// ReplayedHeader is the response header set to "true" on a replayed
// response, like the gRPC trailer [ReplayedTrailer].
const ReplayedHeader = "Idempotency-Replayed"

// HTTPMiddleware returns net/http middleware (the func(http.Handler)
// http.Handler shape of chi and most routers) that runs each request
// carrying an Idempotency-Key at most once, using store: the same engine,
// and the same guarantee, as [UnaryServerInterceptor].
//
// The handler writes through the request's transaction ([TxFromContext] on
// r.Context()); its writes, the key and the stored response commit
// together. A retry of a finished request gets the stored response: the
// same status and body, byte for byte, and the headers that describe the
// body (Content-Type, Location and the others of [DefaultReplayedHeaders],
// plus [WithHTTPReplayedHeaders]), with "Idempotency-Replayed: true".
//
// POST and PATCH are protected by default; other methods pass through, as
// RFC 9110 makes them idempotent ([WithHTTPMethods] changes that; give a
// route its own middleware for its own settings). So does a request the
// router behind will not route, when the middleware can tell (it wraps an
// *http.ServeMux, or [WithHTTPRoute] says): the router's 404, 405 or
// redirect to the canonical path is not stored under a key. So does a
// request that is already inside an idempotent call: the middleware mounted twice (on a
// router group and on its route) protects it once, with the outer one's
// settings. On a protected method:
//
//	no key (when required)            400, problem+json
//	invalid key                       400
//	the key's request still running   409 Conflict, Retry-After
//	the key used for another request  422 Unprocessable Content
//	the database unavailable          503 Service Unavailable, Retry-After
//	the store misconfigured           500
//	the body not read in time         408 (see [WithHTTPReadTimeout])
//
// Error bodies are application/problem+json (RFC 9457). The key is read as
// the draft's structured-field string ("abc") or a bare token (abc).
//
// The request is the same request when its method, path (with query),
// host, Content-Type and body are the same: the path and host the client
// sent (r.RequestURI, r.Host), whatever a router in front
// (http.StripPrefix) rewrote; the Content-Type as RFC 9110 reads it (the
// media type, parameter names and a charset's name in any case); the body
// by its bytes (JSON, application/json or a +json type, by its value:
// spacing, member order and string escapes do not count, numbers as
// written do), and a form by its fields and files, also when a middleware
// in front parsed it (consuming the bytes), so that a form is one request
// whether or not something in front parsed it. The keys the handler
// derives for its downstream calls ([EffectKey], [HTTPTransport]) follow
// the same comparison: a retry that is the same request derives the same
// keys, however it is written (see [EffectKey]).
// The scope ([WithHTTPScope]) is asked before the body is read. Trailers go
// out as trailers and are stored and replayed by the same list as headers;
// a 1xx response other than 101 goes out at once, unstored. Which handler
// responses are stored: see
// [DefaultFinalStatus]. A handler that streams (Flush, Hijack, full duplex
// through http.ResponseController) gets an error from those calls, and a
// response over the size limit ([WithHTTPMaxResponseBytes]) fails the
// request with 500 and stores nothing: a stored response is always whole.
//
// It panics if store is nil or an option is invalid.
func HTTPMiddleware(store *Store, opts ...HTTPOption) func(http.Handler) http.Handler {
	if store == nil {
		panic("idempotency: HTTPMiddleware: store is nil")
	}
	o := defaultHTTPOptions()
	for _, opt := range opts {
		opt(&o)
	}
	if err := o.validate(); err != nil {
		panic(err.Error())
	}
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if _, inCall := TxFromContext(r.Context()); !o.methods[r.Method] || inCall {
				// A request already inside an idempotent call (the
				// middleware mounted twice) is protected by the outer one.
				next.ServeHTTP(w, r)
				return
			}
			route, routed := o.route(next, r)
			if !routed {
				// The router answers it (404, 405, a redirect): there is
				// no call to protect, and no key to keep for a day.
				next.ServeHTTP(w, r)
				return
			}
			o.serve(store, next, route, w, r)
		})
	}
}

// HTTPOption configures [HTTPMiddleware]. An invalid value makes
// HTTPMiddleware panic, naming the option.
type HTTPOption func(*httpOptions)

type httpOptions struct {
	methods     map[string]bool
	scope       func(*http.Request) (string, error)
	keyRequired bool
	ttl         time.Duration
	stored      func(status int) bool
	replayed    []string // canonical header names
	maxRequest  int64
	maxResponse int
	readTimeout time.Duration
	isolation   pgx.TxIsoLevel
	routeOf     func(*http.Request) string // see WithHTTPRoute
	err         error
}

func defaultHTTPOptions() httpOptions {
	return httpOptions{
		methods:     map[string]bool{http.MethodPost: true, http.MethodPatch: true},
		scope:       func(*http.Request) (string, error) { return "", nil },
		keyRequired: true,
		ttl:         DefaultTTL,
		stored:      DefaultFinalStatus,
		replayed:    DefaultReplayedHeaders(),
		maxRequest:  1 << 20,
		maxResponse: 1 << 20,
	}
}

func (o *httpOptions) validate() error {
	switch {
	case o.err != nil:
		return o.err
	case o.scope == nil:
		return errors.New("idempotency: WithHTTPScope: function is nil")
	case o.stored == nil:
		return errors.New("idempotency: WithHTTPFinalStatus: function is nil")
	case o.ttl <= 0:
		return fmt.Errorf("idempotency: WithHTTPTTL: must be positive, got %v", o.ttl)
	case o.maxRequest <= 0:
		return fmt.Errorf("idempotency: WithHTTPMaxRequestBytes: must be positive, got %d", o.maxRequest)
	case o.maxResponse <= 0:
		return fmt.Errorf("idempotency: WithHTTPMaxResponseBytes: must be positive, got %d", o.maxResponse)
	}
	if _, ok := beginStatements[o.isolation]; !ok {
		return fmt.Errorf("idempotency: WithHTTPIsolation: %q is not an isolation level of pgx.TxIsoLevel", o.isolation)
	}
	return nil
}

// DefaultFinalStatus reports whether a handler's response with this
// status is final by default: stored and replayed, as the codes of
// [DefaultFinalCodes] are on the gRPC side. 2xx and
// 3xx are, with the handler's writes; 5xx are not (the key is released and
// a retry runs again); of 4xx, those that say the request was decided are
// stored, their writes rolled back as a final error's are (403, 404, 409,
// 410, 412 and the other 4xx), those that say it was never processed are
// not: 400, 401, 408, 413, 414, 415, 422, 429 and 431, so the corrected
// request can reuse its key.
func DefaultFinalStatus(status int) bool {
	switch {
	case status >= 500:
		return false
	case status < 400:
		return true
	}
	switch status {
	case http.StatusBadRequest, http.StatusUnauthorized, http.StatusRequestTimeout,
		http.StatusRequestEntityTooLarge, http.StatusRequestURITooLong, http.StatusUnsupportedMediaType,
		http.StatusUnprocessableEntity, http.StatusTooManyRequests, http.StatusRequestHeaderFieldsTooLarge:
		return false
	}
	return true
}

// DefaultReplayedHeaders returns the response headers a replay carries by
// default: those that describe the body or its resource, without which the
// stored body could not be read as the first one was (Content-Encoding for
// a compressed body). Others (Date, Set-Cookie, tracing headers) belong to
// the first response alone.
func DefaultReplayedHeaders() []string {
	return []string{"Content-Type", "Content-Encoding", "Content-Language", "Content-Location", "Content-Disposition", "Location", "Etag", "Last-Modified"}
}

// neverReplayed are the response headers a replay must not carry: a
// replay goes to whoever sends the same key and body in the same scope,
// who must not receive the first caller's credentials or session; and the
// connection's own headers belong to one connection.
var neverReplayed = map[string]bool{
	"Set-Cookie": true, "Set-Cookie2": true, "Authorization": true, "Proxy-Authorization": true,
	"Proxy-Authenticate": true, "Www-Authenticate": true, "Cookie": true,
	"Connection": true, "Keep-Alive": true, "Transfer-Encoding": true, "Upgrade": true, "Te": true, "Trailer": true,
	"Content-Length": true, // a replay sets its own
}

// replayable reports whether a stored header or trailer (canonical name)
// can go out on a replay: never one of neverReplayed, which the first
// version of the middleware stored with the rest of the response. Of the
// others, a replay sends those its middleware's WithHTTPReplayedHeaders
// allows.
func replayable(name string) bool { return !neverReplayed[name] }

// WithHTTPMethods sets the request methods that are protected; others pass
// through untouched. Defaults to POST and PATCH.
func WithHTTPMethods(methods ...string) HTTPOption {
	return func(o *httpOptions) {
		o.methods = map[string]bool{}
		for _, m := range methods {
			if m == "" || strings.ToUpper(m) != m {
				o.err = fmt.Errorf("idempotency: WithHTTPMethods: %q is not a method name in upper case", m)
				return
			}
			o.methods[m] = true
		}
	}
}

// WithHTTPScope sets the function that names the caller's key scope from
// the request, usually from the identity an authentication middleware put
// in r.Context(). An error rejects the request with 401 (wrap it in a
// status error to choose: codes.PermissionDenied gives 403). Defaults to
// one scope shared by every caller; see [WithScope] for why that is only
// safe when all callers trust each other. No default can be derived from
// the Authorization header: tokens rotate between a call and its retry, so
// scope by the caller the token names, not by the token.
func WithHTTPScope(f func(r *http.Request) (string, error)) HTTPOption {
	return func(o *httpOptions) { o.scope = f }
}

// WithHTTPKeyOptional lets a protected request without a key pass through
// unprotected. Without it, the default, such a request is refused with
// 400: the middleware protects only the methods and routes it is mounted
// on, so a request there without a key is a client's mistake (the server
// interceptor's default is the other way round; see [WithKeyRequired]).
func WithHTTPKeyOptional() HTTPOption {
	return func(o *httpOptions) { o.keyRequired = false }
}

// WithHTTPTTL sets how long finished keys are kept. Defaults to 24 hours.
func WithHTTPTTL(ttl time.Duration) HTTPOption {
	return func(o *httpOptions) { o.ttl = ttl }
}

// WithHTTPFinalStatus replaces [DefaultFinalStatus]: f reports whether a
// handler's response with a status is stored and replayed (true) or
// releases the key, its writes rolled back (false). f must not be nil.
func WithHTTPFinalStatus(f func(status int) bool) HTTPOption {
	return func(o *httpOptions) { o.stored = f }
}

// WithHTTPReplayedHeaders adds response headers a replay carries, to
// [DefaultReplayedHeaders]. Headers that carry credentials or a session
// (Set-Cookie, Authorization and the like) and those of the connection
// (Connection, Transfer-Encoding, ...) are refused: a replay goes to
// whoever sends the same key and body in the same scope.
func WithHTTPReplayedHeaders(names ...string) HTTPOption {
	return func(o *httpOptions) {
		for _, n := range names {
			c := http.CanonicalHeaderKey(n)
			if neverReplayed[c] {
				o.err = fmt.Errorf("idempotency: WithHTTPReplayedHeaders: %s is never replayed: a replay goes to whoever sends the same key and request, who must not get the first caller's credentials, session or connection headers", c)
				return
			}
			o.replayed = append(o.replayed, c)
		}
	}
}

// WithHTTPIsolation sets the isolation level of the protected requests'
// transactions (see [WithIsolation]). Defaults to "", the store's.
func WithHTTPIsolation(level pgx.TxIsoLevel) HTTPOption {
	return func(o *httpOptions) { o.isolation = level }
}

// WithHTTPMaxRequestBytes bounds the request body, which is read whole to
// be fingerprinted; a larger one gets 413, and so does one whose declared
// Content-Length is larger. A form sent without a Content-Length (chunked)
// is held to it by the size of its encoded fields and files, whether or
// not a middleware in front parsed it, so that it gets one answer either
// way. Defaults to 1 MiB.
func WithHTTPMaxRequestBytes(n int64) HTTPOption {
	return func(o *httpOptions) { o.maxRequest = n }
}

// WithHTTPMaxResponseBytes bounds the response body that is stored; a
// handler that writes more fails the request with 500, its writes rolled
// back, nothing stored. Defaults to 1 MiB.
func WithHTTPMaxResponseBytes(n int) HTTPOption {
	return func(o *httpOptions) { o.maxResponse = n }
}

// WithHTTPReadTimeout sets how long the middleware waits for a protected
// request's body, counted from when it starts reading it: it sets the
// connection's read deadline, replacing the server's ReadTimeout for that
// read. The body is read whole before the handler runs (it is part of the
// request's fingerprint), so a handler that extends the read deadline for a
// slow upload (http.ResponseController's SetReadDeadline) does so too late:
// give the time here instead. A read that times out gets 408 Request
// Timeout. Defaults to 0: the server's own deadlines apply.
func WithHTTPReadTimeout(d time.Duration) HTTPOption {
	return func(o *httpOptions) {
		if d < 0 {
			o.err = fmt.Errorf("idempotency: WithHTTPReadTimeout: must not be negative, got %v", d)
		}
		o.readTimeout = d
	}
}

// errHTTPReleased marks a handler response that is not stored: the writes
// roll back and the key is released, but the response is still sent.
var errHTTPReleased = errors.New("idempotency: response not stored")

// serve protects one request; route is its traced method (see
// httpOptions.route).
func (o *httpOptions) serve(store *Store, next http.Handler, route string, w http.ResponseWriter, r *http.Request) {
	key, err := keyFromHeader(r.Header)
	if err == nil && key == "" {
		if !o.keyRequired {
			next.ServeHTTP(w, r)
			return
		}
		err = ErrMissingKey.with("send it in the "+HeaderKey+" header", nil).about(HeaderKey)
	}
	tp := &transport{kind: TransportHTTP, namespace: namespaceHTTP, responseType: httpBodyType,
		// A FailedPrecondition the engine finds at COMMIT (a deferred
		// unique or exclusion constraint; a missing foreign key row is
		// never final) is stored when a 409 would be.
		finalCode: func(c codes.Code) bool { return c == codes.FailedPrecondition && o.stored(http.StatusConflict) }}
	var outcome Outcome
	var traced error
	report := func(o Outcome, status int, err error) {
		outcome, traced = o, err
		tp.trace.setHTTPStatus(status)
	}
	if store.opts.tracer != nil {
		var ctx context.Context
		ctx, tp.trace = store.startCall(r.Context(), TransportHTTP, route, r.Header.Get(HeaderKey))
		r = r.WithContext(ctx)
		defer tp.trace.endDeferred(ctx, &outcome, &traced)
	}
	if err != nil {
		report(OutcomeRejected, writeProblem(w, err, store.opts.retryDelay), err)
		return
	}
	// The scope before the body: a caller who is refused costs no read,
	// and an "Expect: 100-continue" is not answered for them.
	scope, err := o.scope(r)
	if err != nil {
		if _, ok := status.FromError(err); !ok {
			err = status.Errorf(codes.Unauthenticated, "idempotency: scope: %v", err)
		}
		report(OutcomeRejected, writeProblem(w, err, 0), err)
		return
	}
	body, code, err := o.readBody(w, r)
	if err != nil {
		report(OutcomeRejected, problem(w, code, http.StatusText(code), status.Convert(err).Message(), 0), err)
		return
	}
	method, target := requestName(r)
	fp, code, err := httpFingerprint(r, target, body, o.maxRequest)
	if err != nil {
		report(OutcomeRejected, problem(w, code, http.StatusText(code), status.Convert(err).Message(), 0), err)
		return
	}
	call := Call{Scope: scope, Key: key, TTL: o.ttl, Isolation: o.isolation, Method: method, Fingerprint: fp}
	rec := &responseRecorder{}
	tp.metadata = func() ([]byte, error) { return rec.encode(o.replayed) }
	res, err := store.execute(r.Context(), call, tp, func(ctx context.Context, _ pgx.Tx) (proto.Message, error) {
		// A fresh recorder for each run: an earlier one rolled back.
		*rec = responseRecorder{header: http.Header{}, max: o.maxResponse, w: w}
		req := r.WithContext(ctx)
		req.Body = io.NopCloser(bytes.NewReader(body))
		next.ServeHTTP(rec, req)
		rec.finish()
		code := rec.statusCode()
		switch {
		case rec.tooLarge:
			return nil, status.Errorf(codes.Internal, "idempotency: the handler wrote over %d bytes of response body, the most that can be stored; nothing was committed", o.maxResponse)
		case !o.stored(code):
			return nil, errHTTPReleased
		case code >= 400:
			// A decided failure, stored like a gRPC handler's final
			// error: its writes roll back, the response is kept.
			return wrapperspb.Bytes(rec.body.Bytes()), Final(status.Errorf(codes.FailedPrecondition, "the handler answered %d", code))
		}
		return wrapperspb.Bytes(rec.body.Bytes()), nil
	})
	switch {
	case errors.Is(err, errHTTPReleased):
		// The handler's own answer; its writes rolled back.
		rec.writeTo(w, nil, false)
		report(OutcomeReleased, rec.statusCode(), nil)
	case res.Outcome == OutcomeExecuted && res.Response != nil && (err == nil || IsFinal(err)):
		rec.writeTo(w, nil, false)
		report(res.Outcome, rec.statusCode(), nil)
	case res.Outcome == OutcomeReplayed && res.Response != nil && (err == nil || IsFinal(err)):
		stored, err := decodeHTTPResponse(res)
		if err != nil {
			report(res.Outcome, writeProblem(w, err, 0), err)
			return
		}
		stored.writeTo(w, o.replayed, true)
		report(res.Outcome, stored.statusCode(), nil)
	case err != nil && r.Context().Err() != nil && errors.Is(err, r.Context().Err()):
		report(res.Outcome, 0, err) // the client is gone; nothing to write
	default:
		if res.Outcome == OutcomeReplayed && IsFinal(err) {
			// A stored error of the engine's, replayed as a stored response
			// is, and said so.
			w.Header().Set(ReplayedHeader, "true")
		}
		report(res.Outcome, writeProblem(w, err, store.opts.retryDelay), err)
	}
}

// readBody reads the request body whole, to fingerprint it, within the
// read timeout when one is set. It returns the status of a failure: 413
// over the limit, 408 when the server's read deadline passed (the
// server's timeout, not the client's mistake), 400 otherwise.
func (o *httpOptions) readBody(w http.ResponseWriter, r *http.Request) ([]byte, int, error) {
	if o.readTimeout > 0 {
		if err := http.NewResponseController(w).SetReadDeadline(time.Now().Add(o.readTimeout)); err != nil {
			return nil, http.StatusInternalServerError, status.Errorf(codes.Internal, "idempotency: WithHTTPReadTimeout: the connection's read deadline cannot be set (%v): "+
				"a middleware in front of this one wraps the ResponseWriter without an Unwrap method", err)
		}
	}
	if r.ContentLength > o.maxRequest {
		// Declared over the limit: refused before a byte is read, whether
		// or not a middleware in front read it.
		return nil, http.StatusRequestEntityTooLarge, errTooLarge(o.maxRequest)
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, readLimit(r, o.maxRequest)))
	var tooLarge *http.MaxBytesError
	switch {
	case err == nil:
		return body, 0, nil
	case errors.As(err, &tooLarge):
		return nil, http.StatusRequestEntityTooLarge, errTooLarge(o.maxRequest)
	case errors.Is(err, os.ErrDeadlineExceeded):
		return nil, http.StatusRequestTimeout, status.Errorf(codes.DeadlineExceeded,
			"idempotency: the server's read deadline passed while reading the request body; nothing ran. The body is read before the handler runs, "+
				"so a read deadline the handler sets comes too late: the server's operator can allow more with WithHTTPReadTimeout")
	}
	return nil, http.StatusBadRequest, status.Errorf(codes.InvalidArgument, "idempotency: reading the request body: %v", err)
}

// requestName returns the call's method and the request target it is
// fingerprinted with, from what the client sent (r.RequestURI), not from
// r.URL, which a router in front (http.StripPrefix) may have rewritten: two
// routes that differ only in a stripped prefix are different calls. A
// method over the limit PostgreSQL stores is kept short with a hash of its
// path.
func requestName(r *http.Request) (method, target string) {
	path, query := r.URL.EscapedPath(), r.URL.RawQuery
	if r.RequestURI != "" && r.RequestURI != "*" {
		if u, err := url.ParseRequestURI(r.RequestURI); err == nil {
			path, query = u.EscapedPath(), u.RawQuery
		}
	}
	target = path
	if query != "" {
		target += "?" + query
	}
	method = r.Method + " " + path
	if len(method) > maxMethodLen {
		sum := sha256.Sum256([]byte(method))
		method = fmt.Sprintf("%s sha256:%x", r.Method, sum)
	}
	return method, target
}

// keyFromHeader reads the Idempotency-Key header: a structured-field
// string ("abc", as the draft specifies) or a bare token (abc, as most
// clients send). "" when there is none.
func keyFromHeader(h http.Header) (string, error) {
	vals := h.Values(HeaderKey)
	switch len(vals) {
	case 0:
		return "", nil
	case 1:
	default:
		return "", invalidKey(HeaderKey, fmt.Sprintf("%d %s headers sent, exactly one is allowed", len(vals), HeaderKey))
	}
	key := strings.TrimSpace(vals[0])
	if strings.HasPrefix(key, `"`) {
		unquoted, err := parseSFString(key)
		if err != nil {
			return "", invalidKey(HeaderKey, err.Error())
		}
		key = unquoted
	}
	if err := ValidateKey(key); err != nil {
		return "", keyError(err, HeaderKey, "")
	}
	return key, nil
}

// parseSFString parses a structured-field string (RFC 8941 section 3.3.3):
// a quoted string whose only escapes are \" and \\.
func parseSFString(s string) (string, error) {
	if len(s) < 2 || s[len(s)-1] != '"' {
		return "", errors.New(`the key starts with '"' but is not a quoted string`)
	}
	var b strings.Builder
	for i := 1; i < len(s)-1; i++ {
		c := s[i]
		switch {
		case c == '\\':
			i++
			if i == len(s)-1 || (s[i] != '"' && s[i] != '\\') {
				return "", errors.New(`a quoted key may only escape '"' and '\'`)
			}
			b.WriteByte(s[i])
		case c == '"':
			return "", errors.New("the quoted key has text after its closing quote")
		default:
			b.WriteByte(c)
		}
	}
	return b.String(), nil
}

// responseRecorder is the http.ResponseWriter a protected handler gets: it
// keeps the whole response, to store it and then send it. Like net/http's
// own writer, it takes the headers as they are when the status is written
// (later changes are ignored), and the trailers (the names the Trailer
// header declared, and those set with http.TrailerPrefix) when the handler
// returns.
type responseRecorder struct {
	header   http.Header // the handler's
	sent     http.Header // the headers of the response, canonical names
	trailer  http.Header // its trailers, canonical names
	declared []string    // the trailers the Trailer header declared
	status   int
	body     bytes.Buffer
	max      int
	tooLarge bool
	w        http.ResponseWriter // the real writer: for 1xx responses and deadlines
}

var errNoStreaming = errors.New("idempotency: a response that is stored cannot be streamed (flushed, hijacked or written in full duplex); it is sent whole once the call commits")

func (rr *responseRecorder) Header() http.Header { return rr.header }

func (rr *responseRecorder) WriteHeader(code int) {
	// As net/http: an invalid code is the handler's bug; a 1xx response
	// other than 101 is informational and goes to the client now, with the
	// headers set so far (103 Early Hints), unstored; after the first final
	// status, later ones are ignored.
	if code < 100 || code > 999 {
		panic(fmt.Sprintf("idempotency: invalid WriteHeader code %v", code))
	}
	switch {
	case rr.status != 0:
	case code < 200 && code != http.StatusSwitchingProtocols:
		// The real writer's headers as they were after: what the handler
		// set for the 1xx goes with the final response only if it is still
		// set then, as with net/http's own writer.
		h := rr.w.Header()
		before := h.Clone()
		for name, values := range rr.header {
			h[name] = slices.Clone(values)
		}
		rr.w.WriteHeader(code)
		clear(h)
		maps.Copy(h, before)
	default:
		rr.status = code
		rr.snapshot()
	}
}

// snapshot takes the headers of the response when its status is written.
func (rr *responseRecorder) snapshot() {
	rr.sent = http.Header{}
	for name, values := range rr.header {
		if strings.HasPrefix(name, http.TrailerPrefix) {
			continue
		}
		c := http.CanonicalHeaderKey(name)
		rr.sent[c] = append(rr.sent[c], values...)
	}
	for _, v := range rr.sent["Trailer"] {
		for _, name := range strings.Split(v, ",") {
			if name = strings.TrimSpace(name); name != "" {
				rr.declared = append(rr.declared, http.CanonicalHeaderKey(name))
			}
		}
	}
	delete(rr.sent, "Trailer") // declared again for the trailers there are
}

// finish takes the trailers once the handler returned.
func (rr *responseRecorder) finish() {
	if rr.status == 0 {
		rr.status = http.StatusOK // a handler that wrote nothing
		rr.snapshot()
	}
	rr.trailer = http.Header{}
	for name, values := range rr.header {
		switch {
		case strings.HasPrefix(name, http.TrailerPrefix):
			c := http.CanonicalHeaderKey(strings.TrimPrefix(name, http.TrailerPrefix))
			rr.trailer[c] = append(rr.trailer[c], values...)
		case slices.Contains(rr.declared, http.CanonicalHeaderKey(name)) && len(values) > 0:
			c := http.CanonicalHeaderKey(name)
			rr.trailer[c] = append(rr.trailer[c], values...)
		}
	}
}

func (rr *responseRecorder) Write(p []byte) (int, error) {
	if rr.status == 0 {
		rr.WriteHeader(http.StatusOK)
	}
	if rr.body.Len()+len(p) > rr.max {
		rr.tooLarge = true
		return 0, fmt.Errorf("idempotency: response body over %d bytes", rr.max)
	}
	return rr.body.Write(p)
}

// FlushError, Hijack and EnableFullDuplex are what http.ResponseController
// calls: a stored response is sent whole, so they fail.
func (rr *responseRecorder) FlushError() error { return errNoStreaming }

func (rr *responseRecorder) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	return nil, nil, errNoStreaming
}

func (rr *responseRecorder) EnableFullDuplex() error { return errNoStreaming }

// SetReadDeadline and SetWriteDeadline pass to the real connection.
func (rr *responseRecorder) SetReadDeadline(t time.Time) error {
	return http.NewResponseController(rr.w).SetReadDeadline(t)
}

func (rr *responseRecorder) SetWriteDeadline(t time.Time) error {
	return http.NewResponseController(rr.w).SetWriteDeadline(t)
}

func (rr *responseRecorder) statusCode() int {
	if rr.status == 0 {
		return http.StatusOK // a handler that wrote nothing
	}
	return rr.status
}

// writeTo sends the recorded response: every header and trailer the first
// time, only the allowed ones on a replay. Trailers go out as trailers, on
// HTTP/1.1 (chunked) as on HTTP/2.
func (rr *responseRecorder) writeTo(w http.ResponseWriter, allowed []string, replayed bool) {
	kept := func(name string) bool { return !replayed || (slices.Contains(allowed, name) && replayable(name)) }
	h := w.Header()
	for name, values := range rr.sent {
		if kept(name) {
			h[name] = values
		}
	}
	if replayed {
		h.Set(ReplayedHeader, "true")
	}
	var trailers []string
	for name := range rr.trailer {
		if kept(name) && replayable(name) {
			trailers = append(trailers, name)
		}
	}
	slices.Sort(trailers)
	if len(trailers) > 0 {
		h["Trailer"] = []string{strings.Join(trailers, ", ")}
		h.Del("Content-Length") // so that HTTP/1.1 sends it chunked, with the trailers
	} else {
		h.Set("Content-Length", strconv.Itoa(rr.body.Len()))
	}
	w.WriteHeader(rr.statusCode())
	_, _ = w.Write(rr.body.Bytes())
	for _, name := range trailers {
		h[name] = rr.trailer[name]
	}
}

// encode is the stored form of the response's status and the headers and
// trailers a replay carries (kept: no others are stored, cookies least of
// all): field 1 the status, field 2 each header (name, then values), field
// 3 each trailer, as for gRPC metadata. At most [MaxStoredMetadata] bytes
// of them are stored, as for gRPC.
func (rr *responseRecorder) encode(kept []string) ([]byte, error) {
	b := protowire.AppendVarint(protowire.AppendTag(nil, 1, protowire.VarintType), uint64(rr.statusCode()))
	size := 0
	for _, part := range []struct {
		num protowire.Number
		h   http.Header
	}{{2, rr.sent}, {3, rr.trailer}} {
		for _, name := range slices.Sorted(maps.Keys(part.h)) {
			if !slices.Contains(kept, name) || (part.num == 3 && !replayable(name)) {
				continue
			}
			b = appendEntry(b, part.num, name, part.h[name])
			size += len(name)
			for _, v := range part.h[name] {
				size += len(v)
			}
		}
	}
	if size > MaxStoredMetadata {
		return nil, status.Errorf(codes.Internal, "idempotency: the handler set %d bytes of replayed headers and trailers; at most %d (MaxStoredMetadata) can be stored for replay; nothing was committed", size, MaxStoredMetadata)
	}
	return b, nil
}

// httpBodyType is the type a stored HTTP response's body is kept as.
var httpBodyType = (&wrapperspb.BytesValue{}).ProtoReflect().Type()

// decodeHTTPResponse rebuilds a stored response.
func decodeHTTPResponse(res result) (*responseRecorder, error) {
	body, ok := res.Response.(*wrapperspb.BytesValue)
	if !ok {
		return nil, status.Errorf(codes.Internal, "idempotency: the key's stored result is not an HTTP response (the key was used by a gRPC call?)")
	}
	rr := &responseRecorder{sent: http.Header{}, trailer: http.Header{}}
	rr.body.Write(body.GetValue())
	b := res.metadata
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return nil, status.Errorf(codes.Internal, "idempotency: stored HTTP response is malformed")
		}
		b = b[n:]
		switch {
		case num == 1 && typ == protowire.VarintType:
			v, n := protowire.ConsumeVarint(b)
			if n < 0 || v > math.MaxInt32 {
				return nil, status.Errorf(codes.Internal, "idempotency: stored HTTP status is malformed")
			}
			rr.status, b = int(v), b[n:]
		case (num == 2 || num == 3) && typ == protowire.BytesType:
			entry, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return nil, status.Errorf(codes.Internal, "idempotency: stored HTTP header is malformed")
			}
			name, values, err := decodeEntry(entry)
			if err != nil {
				return nil, status.Errorf(codes.Internal, "idempotency: %v", err)
			}
			if num == 2 {
				rr.sent[name] = values
			} else {
				rr.trailer[name] = values
			}
			b = b[n:]
		default:
			return nil, status.Errorf(codes.Internal, "idempotency: stored HTTP response is malformed")
		}
	}
	return rr, nil
}

// problem writes an RFC 9457 problem+json response and returns its status.
func problem(w http.ResponseWriter, code int, title, detail string, retryAfter time.Duration) int {
	return problemWithReason(w, code, title, detail, retryAfter, "")
}

// problemWithReason is problem with the reason of the library's answer
// (the gRPC side's ErrorInfo reason, KEY_IN_PROGRESS say) as the
// extension member "reason", so that a client tells the library's 409 or
// 422 from a handler's own. The library's answers have one; a handler's
// never does.
func problemWithReason(w http.ResponseWriter, code int, title, detail string, retryAfter time.Duration, reason string) int {
	h := w.Header()
	h.Set("Content-Type", "application/problem+json")
	if retryAfter > 0 {
		h.Set("Retry-After", strconv.Itoa(int(math.Ceil(retryAfter.Seconds()))))
	}
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(struct {
		Type   string `json:"type"`
		Title  string `json:"title"`
		Status int    `json:"status"`
		Detail string `json:"detail"`
		Reason string `json:"reason,omitempty"`
	}{"about:blank", title, code, detail, reason})
	return code
}

// writeProblem answers with the HTTP form of an error of the engine or of
// the middleware, and returns the status sent.
func writeProblem(w http.ResponseWriter, err error, retryDelay time.Duration) int {
	st := status.Convert(err)
	var reason string
	if e := (*Error)(nil); errors.As(err, &e) {
		reason = e.reason
	}
	answer := func(code int, title string, retryAfter time.Duration) int {
		return problemWithReason(w, code, title, st.Message(), retryAfter, reason)
	}
	switch {
	case IsInProgress(err):
		d, _ := RetryDelay(err)
		return answer(http.StatusConflict, "A request with this Idempotency-Key is being processed", max(d, time.Second))
	case IsKeyReused(err):
		return answer(http.StatusUnprocessableEntity, "Idempotency-Key already used for another request", 0)
	case errors.Is(err, ErrInvalidKey), errors.Is(err, ErrMissingKey):
		return answer(http.StatusBadRequest, "Invalid or missing Idempotency-Key", 0)
	}
	switch st.Code() {
	case codes.Unavailable, codes.Aborted:
		return answer(http.StatusServiceUnavailable, "Service unavailable; retry with the same Idempotency-Key", max(retryDelay, time.Second))
	case codes.InvalidArgument:
		return answer(http.StatusBadRequest, "Bad request", 0)
	case codes.Unauthenticated:
		return answer(http.StatusUnauthorized, "Unauthenticated", 0)
	case codes.PermissionDenied:
		return answer(http.StatusForbidden, "Forbidden", 0)
	case codes.FailedPrecondition:
		return answer(http.StatusConflict, "Conflict", 0)
	case codes.DeadlineExceeded:
		return answer(http.StatusGatewayTimeout, "Timed out; nothing was committed", 0)
	}
	return answer(http.StatusInternalServerError, "Internal error", 0)
}
