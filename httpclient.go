package idempotency

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"
)

// HTTPClient sends HTTP requests under one idempotency key per logical
// request, and retries them under that key: for HTTP what
// [UnaryClientInterceptor] does for gRPC. The zero value is ready to use.
// An HTTPClient is safe for concurrent use; do not change its fields while
// it is in use.
//
//	hc := &idempotency.HTTPClient{}
//	req, _ := http.NewRequestWithContext(ctx, "POST", providerURL+"/v1/charges", strings.NewReader(body))
//	resp, err := hc.Do(req) // every attempt carries the same Idempotency-Key
//
// # The key
//
// Do chooses the key of a POST or PATCH request once, before its first
// attempt, and sends it in the [HeaderKey] header of every attempt. It is,
// in order:
//
//   - the request's own Idempotency-Key header, sent as it is (read as
//     [HTTPMiddleware] reads it: a bare token or a structured-field string);
//   - the key of [WithOutgoingKey] in the request's context;
//   - when the request's context is inside a running call (a handler's):
//     the key of the effect [WithEffect] names, the key [HTTPTransport]
//     derives too, so a handler may use both. A re-run of the handler, and
//     a handler that retries the call itself, send the same key;
//   - outside a running call, a new UUIDv7.
//
// An invalid key (in the header or from WithOutgoingKey) is an error of
// [ErrInvalidKey]; a POST or PATCH inside a running call with neither a
// key nor a name is refused with [ErrUnnamedEffect], and one that would
// derive its key from the context of a call that has ended with
// [ErrCallEnded]: nothing is sent and the request's body is closed.
// Other methods are sent without a key of Do's choosing (a header the request carries is sent as it is). A Client
// whose Transport is an HTTPTransport works the same: the request already
// carries its key, which HTTPTransport passes through. Redirects the
// Client follows carry the key too: http.Client copies the request's
// headers to every hop.
//
// # Retries
//
// POST and PATCH (which carry a key) and the methods RFC 9110 makes
// idempotent (GET, HEAD, OPTIONS, TRACE, PUT, DELETE) are attempted up to
// MaxAttempts times; any other method is sent once. A request with a body
// is retried only if req.GetBody can read it again (http.NewRequest sets it
// for a *bytes.Buffer, *bytes.Reader or *strings.Reader): every attempt
// after the first sends GetBody's copy, and a request whose body cannot be
// read again is sent once. Do retries:
//
//   - an error of the Client: a connection refused, reset or cut, an
//     attempt that timed out (Client.Timeout bounds each attempt). Not when
//     the request's context has ended, nor when the Client's CheckRedirect
//     refused a redirect, nor an error of this package;
//   - a 5xx response, except 501, 505 and 511, which say that the same
//     request can never succeed there;
//   - 429 Too Many Requests;
//   - 409 Conflict to a request with a key: the IETF draft's answer (and
//     [HTTPMiddleware]'s) while the key's first request is still in flight.
//
// A response marked "Idempotency-Replayed: true" ([ReplayedHeader]) is never
// retried: it is what the server stored for the key, and a retry would get
// it again. Every other response is returned as it is.
//
// Before retry n Do waits about BackoffBase·2^(n-1), at most BackoffMax, with
// ±20% jitter, and never less than the response's Retry-After (seconds or an
// HTTP date). When that wait would end past the budget or past the request's
// deadline, Do does not wait: it returns what the last attempt got. Budget
// bounds the whole Do: the waits, and each attempt until its response's
// headers arrive (an attempt still running when the budget ends is cut, an
// error wrapping context.DeadlineExceeded); it does not bound reading the
// body of the response returned. The body of a response that is retried is
// read (up to 64 KiB, so that the connection can be used again) and closed.
//
// # What Do returns
//
// The response is the last attempt's, also when its status is one Do
// retries and no attempt or no time is left: a status is not an error, as
// with http.Client. Its Request is the request sent (the last hop of its
// redirects, or the attempt's own copy when the transport answered without
// one), whose header carries the key. Do never modifies req: each attempt
// sends a clone of it.
//
// Every error of a request Do attempted is an [*HTTPRetryError]: the key
// its attempts carried, how many there were and why Do stopped, wrapping
// the last attempt's error. errors.As gives the key even when no attempt
// got an answer, so the application can send the request again later under
// the same key (in the header, or with WithOutgoingKey).
type HTTPClient struct {
	// Client sends each attempt; nil means http.DefaultClient.
	Client *http.Client
	// MaxAttempts bounds the attempts of one Do, the first included: 1
	// turns retries off. 0 means 6 (the first and 5 retries); negative is
	// invalid.
	MaxAttempts int
	// Budget bounds the time of one Do, its attempts and its waits (see
	// above). 0 means 30 seconds; negative is invalid.
	Budget time.Duration
	// BackoffBase and BackoffMax shape the wait before each retry, as
	// WithRetryBackoff does for gRPC. 0 means 50 milliseconds and 2 seconds
	// (BackoffMax at least BackoffBase); negative, or a BackoffMax set
	// below BackoffBase, is invalid.
	BackoffBase, BackoffMax time.Duration
	// RecordEffects makes a Do whose key is derived from the effect its
	// request's context names a recorded step, as for
	// [HTTPTransport.RecordEffects]: the response Do returns, if no other
	// attempt can change it, is recorded, and a re-run of the running call
	// gets a copy of it without sending.
	RecordEffects bool

	// wait replaces the timer of the waits between attempts (tests).
	wait func(ctx context.Context, d time.Duration) error
}

// HTTPRetryError is the error of an [HTTPClient.Do] that attempted its
// request and has no response to return.
type HTTPRetryError struct {
	// Key is the idempotency key every attempt carried, as a server reads
	// it (a structured-field string unquoted), "" for a request sent
	// without one. Sending the request again under this key (the
	// Idempotency-Key header, or [WithOutgoingKey]) retries the same
	// operation.
	Key string
	// Attempts is how many attempts Do made, the first included.
	Attempts int
	// Err is the last attempt's error, or the context's when it ended
	// while Do waited to retry.
	Err error

	stop string // why Do made no further attempt
}

// Error implements error.
func (e *HTTPRetryError) Error() string {
	attempts := "1 attempt"
	if e.Attempts != 1 {
		attempts = strconv.Itoa(e.Attempts) + " attempts"
	}
	key := "without a key"
	if e.Key != "" {
		key = fmt.Sprintf("under %s %q", HeaderKey, e.Key)
	}
	return fmt.Sprintf("idempotency: %s %s, %s: %v", attempts, key, e.stop, e.Err)
}

// Unwrap returns Err.
func (e *HTTPRetryError) Unwrap() error { return e.Err }

// drainLimit is how much of a retried response's body is read before it is
// closed, so that its connection can serve the next attempt.
const drainLimit = 64 << 10

// maxRetryAfter caps a Retry-After in seconds, so that a huge one cannot
// overflow a time.Duration (it is past any budget anyway).
const maxRetryAfter = 1 << 31

// defaultHTTPAttempts is the MaxAttempts of an HTTPClient that sets none.
const defaultHTTPAttempts = 6

type httpClientSettings struct {
	attempts              int
	budget, base, ceiling time.Duration
	wait                  func(ctx context.Context, d time.Duration) error
	client                *http.Client
}

func (c *HTTPClient) settings() (httpClientSettings, error) {
	d := defaultClientOptions()
	s := httpClientSettings{attempts: defaultHTTPAttempts, budget: 30 * time.Second, base: d.backoffBase, client: c.Client, wait: c.wait}
	switch {
	case c.MaxAttempts < 0:
		return s, fmt.Errorf("idempotency: HTTPClient: MaxAttempts must not be negative, got %d", c.MaxAttempts)
	case c.Budget < 0:
		return s, fmt.Errorf("idempotency: HTTPClient: Budget must not be negative, got %v", c.Budget)
	case c.BackoffBase < 0 || c.BackoffMax < 0:
		return s, fmt.Errorf("idempotency: HTTPClient: BackoffBase and BackoffMax must not be negative, got %v and %v", c.BackoffBase, c.BackoffMax)
	}
	if c.MaxAttempts > 0 {
		s.attempts = c.MaxAttempts
	}
	if c.Budget > 0 {
		s.budget = c.Budget
	}
	if c.BackoffBase > 0 {
		s.base = c.BackoffBase
	}
	s.ceiling = max(d.backoffMax, s.base)
	if c.BackoffMax > 0 {
		if c.BackoffMax < s.base {
			return s, fmt.Errorf("idempotency: HTTPClient: BackoffMax %v is below BackoffBase %v", c.BackoffMax, s.base)
		}
		s.ceiling = c.BackoffMax
	}
	if s.client == nil {
		s.client = http.DefaultClient
	}
	if s.wait == nil {
		s.wait = sleepContext
	}
	return s, nil
}

// Do sends req under its key, retrying as the type's documentation says,
// and returns the last attempt's response, or an [*HTTPRetryError]. An
// invalid key, an unnamed effect, an ended call or an invalid field of c
// is an error before anything is sent. As with http.Client, the caller closes the response's
// body.
func (c *HTTPClient) Do(req *http.Request) (*http.Response, error) {
	if c.RecordEffects {
		if _, err := c.settings(); err != nil {
			closeBody(req)
			return nil, err
		}
		if resp, recorded, err := httpStep(req, c.do); recorded {
			return resp, err
		}
	}
	return c.do(req)
}

func (c *HTTPClient) do(req *http.Request) (*http.Response, error) {
	s, err := c.settings()
	if err != nil {
		closeBody(req)
		return nil, err
	}
	key, own, err := httpClientKey(req)
	if err != nil {
		closeBody(req)
		return nil, err
	}
	keyed := key != ""
	call, inCall := callFrom(req.Context())
	_, explicit := req.Context().Value(outgoingKey{}).(string)
	derived := keyed && !own && !explicit && inCall
	limit, once := s.attempts, ""
	switch {
	case !keyed && !idempotentMethod(req.Method):
		limit, once = 1, fmt.Sprintf("sent once: %s is neither idempotent nor sent with a key", req.Method)
	case req.Body != nil && req.Body != http.NoBody && req.GetBody == nil:
		limit, once = 1, "sent once: the request's body cannot be read again (it has no GetBody)"
	}
	ctx := req.Context()
	budgetEnd := time.Now().Add(s.budget)
	end, endName := budgetEnd, fmt.Sprintf("the budget of %v", s.budget)
	if d, ok := ctx.Deadline(); ok && d.Before(end) {
		end, endName = d, "the request's deadline"
	}
	fail := func(attempts int, stop string, err error) error {
		return &HTTPRetryError{Key: key, Attempts: attempts, Err: err, stop: stop}
	}
	for attempt := 1; ; attempt++ {
		if attempt > 1 && derived && call.ended() {
			// The key was derived for a call that is over (a goroutine the
			// handler left behind retries): nothing more is sent under it.
			return nil, fail(attempt-1, "the call the key was derived for has ended", ErrCallEnded.with(req.Method+" "+req.URL.EscapedPath(), nil))
		}
		actx, cancel := context.WithCancelCause(ctx)
		r := req.Clone(actx)
		if attempt > 1 && req.GetBody != nil {
			body, err := req.GetBody()
			if err != nil {
				cancel(nil)
				return nil, fail(attempt-1, "reading the request's body again for the next attempt failed", fmt.Errorf("GetBody: %w", err))
			}
			r.Body = body
		}
		if keyed && !own {
			if r.Header == nil { // a request built by hand
				r.Header = make(http.Header)
			}
			r.Header.Set(HeaderKey, headerValue(key))
		}
		// The budget cuts the attempt until its response's headers arrive.
		// (Should it run out in the instant after they did, reading that
		// body fails with the budget's error, which is then the truth.)
		cut := time.AfterFunc(time.Until(budgetEnd), func() { cancel(errBudget) })
		resp, err := s.client.Do(r)
		budgetRanOut := !cut.Stop()

		if err != nil {
			cancel(nil)
			var pkgErr *Error
			switch {
			case budgetRanOut && ctx.Err() == nil:
				return nil, fail(attempt, fmt.Sprintf("cut when the budget of %v ran out", s.budget),
					fmt.Errorf("%w: %v", context.DeadlineExceeded, err))
			case ctx.Err() != nil:
				return nil, fail(attempt, "the request's context ended", err)
			case resp != nil: // http.Client closed its body
				return nil, fail(attempt, "the Client's CheckRedirect refused a redirect", err)
			case errors.As(err, &pkgErr):
				return nil, fail(attempt, "not retried", err)
			case attempt >= limit:
				return nil, fail(attempt, cmp.Or(once, "no attempts left"), err)
			}
		} else {
			if resp.Request == nil {
				resp.Request = r
			}
			retry, after := retryableResponse(resp, keyed)
			if !retry || attempt >= limit {
				return cancelOnClose(resp, cancel), nil
			}
			wait := backoffDelay(uint(attempt), s.base, s.ceiling, rand.Float64(), after)
			if time.Now().Add(wait).After(end) {
				return cancelOnClose(resp, cancel), nil
			}
			// The body is drained during the wait, and cut when the wait
			// ends: a body that never ends cannot make Do wait longer.
			drained := make(chan struct{})
			go func() {
				defer close(drained)
				_, _ = io.CopyN(io.Discard, resp.Body, drainLimit)
				_ = resp.Body.Close()
			}()
			werr := s.wait(ctx, wait)
			cancel(errDrainTooSlow)
			<-drained
			if werr != nil {
				return nil, fail(attempt, "the request's context ended while waiting to retry after "+resp.Status, werr)
			}
			continue
		}
		wait := backoffDelay(uint(attempt), s.base, s.ceiling, rand.Float64(), 0)
		if time.Now().Add(wait).After(end) {
			return nil, fail(attempt, fmt.Sprintf("%s leaves no time for the next wait (%v)", endName, wait.Round(time.Millisecond)), err)
		}
		if werr := s.wait(ctx, wait); werr != nil {
			return nil, fail(attempt, "the request's context ended while waiting to retry",
				fmt.Errorf("%w (the last attempt failed: %v)", werr, err))
		}
	}
}

// errDrainTooSlow is the cause that cuts a retried response's body still
// being read when the wait before the next attempt ends.
var errDrainTooSlow = errors.New("the body of a retried response took longer to read than the wait before the next attempt")

// errBudget is the cause of an attempt cut by the end of the budget.
var errBudget = errors.New("the HTTPClient's budget ran out")

// httpClientKey is the one key of a Do of req, "" for a request sent
// without one; own reports that it is the request's own header.
func httpClientKey(req *http.Request) (key string, own bool, err error) {
	if !keyedMethod(req.Method) {
		return "", false, nil
	}
	key, err = keyFromHeader(req.Header)
	switch {
	case err != nil:
		return "", false, keyError(err, HeaderKey, "the request's header")
	case key != "":
		return key, true, nil
	}
	key, ok, err := httpRequestKey(req)
	if err != nil || ok {
		return key, false, err
	}
	k, err := uuid.NewV7()
	if err != nil {
		return "", false, fmt.Errorf("idempotency: generate key: %w", err)
	}
	return k.String(), false, nil
}

// idempotentMethod reports whether RFC 9110 makes method idempotent, so
// that it may be sent again without a key.
func idempotentMethod(method string) bool {
	switch method {
	case http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace, http.MethodPut, http.MethodDelete:
		return true
	}
	return false
}

// retryableResponse reports whether resp is worth another attempt, and
// the Retry-After it asks for.
func retryableResponse(resp *http.Response, keyed bool) (bool, time.Duration) {
	if resp.Header.Get(ReplayedHeader) == "true" {
		return false, 0
	}
	switch code := resp.StatusCode; {
	case code == http.StatusConflict && keyed, code == http.StatusTooManyRequests:
	case code == http.StatusNotImplemented, code == http.StatusHTTPVersionNotSupported, code == http.StatusNetworkAuthenticationRequired:
		return false, 0
	case code >= 500 && code < 600:
	default:
		return false, 0
	}
	return true, retryAfter(resp.Header)
}

// retryAfter is the delay a Retry-After header asks for: delay-seconds or
// an HTTP date; 0 for none, one in the past, or one that does not parse.
func retryAfter(h http.Header) time.Duration {
	v := strings.TrimSpace(h.Get("Retry-After"))
	if v == "" {
		return 0
	}
	if n, err := strconv.ParseUint(v, 10, 64); err == nil {
		return time.Duration(min(n, maxRetryAfter)) * time.Second
	}
	if t, err := http.ParseTime(v); err == nil {
		return max(time.Until(t), 0)
	}
	return 0
}

// sleepContext waits d, or until ctx ends.
func sleepContext(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return context.Cause(ctx)
	}
}

// cancelOnClose ties the end of the attempt's context to the closing of
// the body of the response Do returns: the body is read under it.
func cancelOnClose(resp *http.Response, cancel context.CancelCauseFunc) *http.Response {
	switch b := resp.Body.(type) {
	case nil:
		cancel(nil)
	case io.ReadWriteCloser: // a 101 Switching Protocols body
		resp.Body = &cancelingReadWriteCloser{b, cancel}
	default:
		if b == http.NoBody {
			cancel(nil)
			break
		}
		resp.Body = &cancelingReadCloser{b, cancel}
	}
	return resp
}

type cancelingReadCloser struct {
	io.ReadCloser
	cancel context.CancelCauseFunc
}

func (b *cancelingReadCloser) Close() error {
	err := b.ReadCloser.Close()
	b.cancel(nil)
	return err
}

type cancelingReadWriteCloser struct {
	io.ReadWriteCloser
	cancel context.CancelCauseFunc
}

func (b *cancelingReadWriteCloser) Close() error {
	err := b.ReadWriteCloser.Close()
	b.cancel(nil)
	return err
}
