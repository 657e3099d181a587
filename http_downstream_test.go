package idempotency_test

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/idempotency"
)

// The keys an HTTP request derives for its downstream calls, end to end: a
// handler behind HTTPMiddleware charges a provider (a real HTTP server
// that charges once per key) through HTTPTransport, and a retry that the
// middleware calls the same request charges nothing more.

// keyedProvider is a payment provider over HTTP that charges once per
// Idempotency-Key and replays the charge for a key it has seen.
type keyedProvider struct {
	srv *httptest.Server
	mu  sync.Mutex
	// charges holds the body each key was first charged with.
	charges map[string]string
}

func newKeyedProvider(t *testing.T) *keyedProvider {
	t.Helper()
	p := &keyedProvider{charges: map[string]string{}}
	p.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get(idempotency.HeaderKey)
		b, _ := io.ReadAll(r.Body)
		if key == "" {
			http.Error(w, "an Idempotency-Key is required", http.StatusBadRequest)
			return
		}
		p.mu.Lock()
		defer p.mu.Unlock()
		if _, ok := p.charges[key]; !ok {
			p.charges[key] = string(b)
		}
		_, _ = fmt.Fprintf(w, "charge %d", len(p.charges))
	}))
	t.Cleanup(p.srv.Close)
	return p
}

// distinctKeys is how many charges the provider made: one per key.
func (p *keyedProvider) distinctKeys() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.charges)
}

// It failed when derived keys hashed the whole stored fingerprint, which
// for JSON holds the digest of the body's bytes beside that of its value,
// and for a form the digest of its bytes when they were there to read: a
// run that charged and answered 503 (the key released), then its retry
// written another way (JSON members in another order; a form that a CSRF
// middleware in front parsed on the first attempt only), which the
// middleware calls the same request, charged the provider under another
// key: 2 charges. A downstream key follows what the comparison compares.
func TestHTTPRetryOfTheSameRequestDerivesTheSameKeys(t *testing.T) {
	t.Parallel()
	const (
		jsonType = "application/json"
		formType = "application/x-www-form-urlencoded"
	)
	for _, c := range []struct {
		name, contentType, first, retry string
		// parsedFirst: csrfInFront parses the first attempt's form (it
		// carries no CSRF header) and not the retry's.
		parsedFirst bool
	}{
		{"JSON with its members in another order", jsonType,
			`{"account_id":"acct-1","amount_cents":250}`, `{"amount_cents":250,"account_id":"acct-1"}`, false},
		{"JSON with other whitespace and escapes", jsonType,
			`{"account_id":"acct-1","amount_cents":250}`, "{ \"account_id\" : \"acct\\u002d1\",\n \"amount_cents\" : 250 }", false},
		{"a form parsed in front on the first attempt only", formType,
			"csrf=ok&account_id=acct-1&amount_cents=250", "csrf=ok&account_id=acct-1&amount_cents=250", true},
		{"a form parsed in front, then sent in another order", formType,
			"csrf=ok&account_id=acct-1&amount_cents=250", "amount_cents=250&csrf=ok&account_id=acct-1", true},
		{"a multipart form parsed in front on the first attempt only", "multipart/form-data; boundary=b0undary",
			multipartBody("b0undary"), multipartBody("b0undary"), true},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			provider := newKeyedProvider(t)
			store := migratedStore(t, suiteDB(t))
			client := &http.Client{Transport: &idempotency.HTTPTransport{}}
			var runs atomic.Int64
			handler := idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				n := runs.Add(1)
				ctx := idempotency.WithEffect(r.Context(), "charge order-77")
				req, err := http.NewRequestWithContext(ctx, http.MethodPost, provider.srv.URL+"/v1/charges", strings.NewReader("amount_cents=250"))
				if err != nil {
					http.Error(w, err.Error(), http.StatusInternalServerError)
					return
				}
				resp, err := client.Do(req)
				if err != nil {
					http.Error(w, err.Error(), http.StatusBadGateway)
					return
				}
				b, _ := io.ReadAll(resp.Body)
				_ = resp.Body.Close()
				if n == 1 {
					// The provider charged; the answer is lost (the key is
					// released, the client retries).
					http.Error(w, "the ledger is unavailable", http.StatusServiceUnavailable)
					return
				}
				w.WriteHeader(http.StatusCreated)
				_, _ = fmt.Fprintf(w, "run %d: %s", n, b)
			}))
			srv := httptest.NewServer(csrfInFront(handler))
			t.Cleanup(srv.Close)
			send := func(body string, parsedInFront bool) mountedReply {
				req := mountedPost(t, srv.URL+"/v1/orders/77/pay", c.contentType, body)
				if !parsedInFront {
					req.Header.Set("X-CSRF-Token", "ok")
				}
				return do(t, srv.Client(), req, "order-77")
			}

			first := send(c.first, c.parsedFirst)
			require.Equal(t, http.StatusServiceUnavailable, first.status, first.body)
			require.Equal(t, 1, provider.distinctKeys())
			retry := send(c.retry, false)
			require.Equal(t, http.StatusCreated, retry.status, retry.body)
			require.Equal(t, 1, provider.distinctKeys(), "the retry of the same request charged the provider under another key")
			again := send(c.first, c.parsedFirst)
			require.Equal(t, retry.body, again.body, "the middleware calls the first encoding the same request")
			require.Equal(t, "true", again.header.Get(idempotency.ReplayedHeader))
			require.EqualValues(t, 2, runs.Load())
		})
	}
}

// multipartBody is a multipart form with a CSRF token and a file, with the
// boundary given.
func multipartBody(boundary string) string {
	return strings.Join([]string{
		"--" + boundary,
		`Content-Disposition: form-data; name="csrf"`,
		"",
		"ok",
		"--" + boundary,
		`Content-Disposition: form-data; name="receipt"; filename="r.txt"`,
		"Content-Type: text/plain",
		"",
		"receipt-1",
		"--" + boundary + "--",
		"",
	}, "\r\n")
}

// A corrected request sent again under a key that was released derives
// other keys than the first: the comparison tells the two apart (a 422 once
// one is stored), so the provider must see two charges, not the first
// charge's key with another body. The requests here are multipart bodies
// of more parts than net/http's ReadForm reads (1,000), which a handler
// reads part by part (r.MultipartReader): the middleware compares them by
// their bytes.
func TestHTTPCorrectedRequestDerivesOtherKeys(t *testing.T) {
	t.Parallel()
	const boundary = "b0undary"
	// batch is a multipart form of parts line items, each of cents.
	batch := func(parts, cents int) string {
		var b strings.Builder
		for i := range parts {
			fmt.Fprintf(&b, "--%s\r\nContent-Disposition: form-data; name=\"item%d\"\r\n\r\n%d\r\n", boundary, i, cents)
		}
		fmt.Fprintf(&b, "--%s--\r\n", boundary)
		return b.String()
	}
	provider := newKeyedProvider(t)
	store := migratedStore(t, suiteDB(t))
	client := &http.Client{Transport: &idempotency.HTTPTransport{}}
	var runs atomic.Int64
	handler := idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := runs.Add(1)
		mr, err := r.MultipartReader()
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		total := 0
		for {
			p, err := mr.NextPart()
			if err == io.EOF {
				break
			}
			if err != nil {
				http.Error(w, err.Error(), http.StatusBadRequest)
				return
			}
			b, _ := io.ReadAll(p)
			var cents int
			_, _ = fmt.Sscan(string(b), &cents)
			total += cents
		}
		ctx := idempotency.WithEffect(r.Context(), "charge the batch")
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, provider.srv.URL+"/v1/charges", strings.NewReader(fmt.Sprintf("amount_cents=%d", total)))
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		resp, err := client.Do(req)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
		if n == 1 {
			// The first batch was wrong: the key is released, and the
			// client sends the corrected batch under it.
			http.Error(w, "the batch is refused", http.StatusBadRequest)
			return
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = fmt.Fprintf(w, "charged %d", total)
	}))
	srv := httptest.NewServer(handler)
	t.Cleanup(srv.Close)
	send := func(body string) mountedReply {
		return do(t, srv.Client(), mountedPost(t, srv.URL+"/v1/batches", "multipart/form-data; boundary="+boundary, body), "batch-1")
	}

	first, corrected := batch(1001, 100), batch(1001, 90)
	require.Equal(t, http.StatusBadRequest, send(first).status)
	require.Equal(t, 1, provider.distinctKeys())
	reply := send(corrected)
	require.Equal(t, http.StatusCreated, reply.status, reply.body)
	require.Equal(t, "charged 90090", reply.body)
	again := send(first)
	require.Equal(t, http.StatusUnprocessableEntity, again.status, "sanity: the middleware calls the first batch another request")
	require.Contains(t, again.body, "KEY_REUSED")
	require.EqualValues(t, 2, runs.Load())
	require.Equal(t, 2, provider.distinctKeys(), "the corrected batch was sent to the provider under the first batch's key")
}
