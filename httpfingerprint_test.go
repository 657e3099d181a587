package idempotency_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"mime/multipart"
	"net/http"
	"net/http/httptest"
	"net/textproto"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/exactlyonce/idempotency"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// What tells one HTTP request from another, end to end: the Content-Type
// as RFC 9110 reads it.

// It failed when a charset's name counted as spelled: the retry of
// "application/json; charset=UTF-8" with "charset=utf-8" (another client
// library, another proxy) got 422, as if the key had been reused. Media
// types, parameter names and charset names are case-insensitive, a
// token and a quoted string are one value; the value of any other
// parameter counts as spelled, and another charset is another request.
func TestHTTPContentTypeIsComparedAsRFC9110ReadsIt(t *testing.T) {
	t.Parallel()
	srv, runs := jsonServer(t)
	const body = `{"account_id":"acct-1","amount_cents":250}`
	for i, c := range []struct {
		name, first, retry string
		want               int
	}{
		{"a charset in upper case", "application/json; charset=UTF-8", "application/json; charset=utf-8", http.StatusCreated},
		{"a charset of mixed case, not JSON", "text/plain; charset=ISO-8859-1", "text/plain; charset=iso-8859-1", http.StatusCreated},
		{"a charset quoted", `text/plain; charset="UTF-8"`, "text/plain; charset=utf-8", http.StatusCreated},
		{"a media type and parameter name in upper case", "Application/JSON; Charset=utf-8", "application/json; charset=UTF-8", http.StatusCreated},
		{"another charset", "text/plain; charset=utf-8", "text/plain; charset=iso-8859-1", http.StatusUnprocessableEntity},
		{"another parameter's value in another case", `application/json; profile="https://example.com/A"`, `application/json; profile="https://example.com/a"`, http.StatusUnprocessableEntity},
	} {
		key := fmt.Sprintf("k-type-%d", i)
		first := sendJSON(t, srv, key, c.first, body)
		require.Equal(t, http.StatusCreated, first.status, "%s: %s", c.name, first.body)
		r := sendJSON(t, srv, key, c.retry, body)
		require.Equal(t, c.want, r.status, "%s: %s", c.name, r.body)
		if c.want == http.StatusCreated {
			require.Equal(t, first.body, r.body, c.name)
			require.Equal(t, "true", r.header.Get(idempotency.ReplayedHeader), c.name)
		}
		require.EqualValues(t, i+1, runs.Load(), "%s: one execution per key", c.name)
	}
}

// version5Rows are the fingerprints the release before this one (version
// 5, a Content-Type's parameters as spelled) stored for POST /v1/charges
// to host api.example with the body
// {"amount_cents":100,"account_id":"acct-7"}: computed by that release's
// httpFingerprint.
var version5Rows = []struct {
	contentType, row string
	json             bool // the body is compared by its value
}{
	{"application/json; charset=UTF-8", "ff49444605605f82a04ba0b0da5b4b8faf2a2081a4bc67dab1cf7a7ee4d1825ebac92f35c7063e2a43c3f59b793cd3e8f672128d4f1148c0906ab9bd6f9af2bf0921c4990ee858f931c14918ad1a7045af83f56e3ec5d21a431029bb35ee68f3f8411188bfc0", true},
	{"text/plain; charset=UTF-8", "ff49444605780f4d80fc4bc047a528b61e8b5662a27bcd270b3fc5dbf728dce0452d3169030258f931c14918ad1a7045af83f56e3ec5d21a431029bb35ee68f3f8411188bfc0", false},
}

// A key stored by the release before charset names were compared in any
// case is compared as that release compared it: the retry of the same
// request is replayed (it would get 422 if its Content-Type were compared
// as this release writes it), and the same body under the charset in
// another case, another request to that release, is still 422.
func TestHTTPRetryAcrossTheContentTypeUpgradeIsComparedAsBefore(t *testing.T) {
	t.Parallel()
	db := suiteDB(t)
	srv, runs := jsonServerOn(t, db)
	const body = `{"amount_cents":100,"account_id":"acct-7"}`
	send := func(key, contentType, body string) mountedReply {
		req := mountedPost(t, srv.URL+"/v1/charges", contentType, body)
		req.Host = "api.example"
		return do(t, srv.Client(), req, key)
	}
	i := 0
	for _, v5 := range version5Rows {
		old, err := hex.DecodeString(v5.row)
		require.NoError(t, err)
		reordered := http.StatusUnprocessableEntity // bytes
		if v5.json {
			reordered = http.StatusCreated
		}
		for _, c := range []struct {
			name, retryType, retryBody string
			want                       int
		}{
			{"the same request", v5.contentType, body, http.StatusCreated},
			{"its members in another order", v5.contentType, `{"account_id":"acct-7","amount_cents":100}`, reordered},
			{"the charset in lower case", strings.Replace(v5.contentType, "UTF-8", "utf-8", 1), body, http.StatusUnprocessableEntity},
			{"another value", v5.contentType, `{"amount_cents":900,"account_id":"acct-7"}`, http.StatusUnprocessableEntity},
		} {
			i++
			key := fmt.Sprintf("k-v5-%d", i)
			first := send(key, v5.contentType, body)
			require.Equal(t, http.StatusCreated, first.status, first.body)
			tag, err := db.Pool.Exec(context.Background(), `UPDATE idempotency_keys SET fingerprint = $1 WHERE key LIKE '%'||$2`, old, key)
			require.NoError(t, err)
			require.EqualValues(t, 1, tag.RowsAffected())
			r := send(key, c.retryType, c.retryBody)
			require.Equal(t, c.want, r.status, "%s, %s: %s", v5.contentType, c.name, r.body)
			if c.want == http.StatusCreated {
				require.Equal(t, first.body, r.body, c.name)
				require.Equal(t, "true", r.header.Get(idempotency.ReplayedHeader), c.name)
			}
			require.EqualValues(t, i, runs.Load(), "%s, %s: one execution per key", v5.contentType, c.name)
		}
	}
}

// queryParsedInFront calls r.FormValue (which parses the form, setting
// r.PostForm even when the body is not a form) only when X-Skip is absent:
// one attempt of a request is parsed in front, its retry is not.
func queryParsedInFront(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("X-Skip") == "" {
			_ = r.FormValue("token")
		}
		next.ServeHTTP(w, r)
	})
}

// chunked makes req's body of unknown length (Transfer-Encoding: chunked).
func chunked(req *http.Request) *http.Request {
	req.Body = io.NopCloser(struct{ io.Reader }{req.Body})
	req.ContentLength = -1
	req.GetBody = nil
	return req
}

// It failed because an empty body that a middleware in front "parsed" (a
// r.FormValue on a POST without a form type leaves r.PostForm empty, not
// nil) is fingerprinted with neither a body nor a form digest, while the
// same request unparsed has the body digest of no bytes: the retry of the
// same empty POST gets 422 only because of where it was parsed. So does a
// multipart body ParseMultipartForm read whole and failed on (r.PostForm
// empty, r.MultipartForm nil), which the handler fails to parse either way.
func TestHTTPBodyParsedInFrontToNoFormIsTheSameRequestAsUnparsed(t *testing.T) {
	t.Parallel()
	store := migratedStore(t, suiteDB(t))
	var runs atomic.Int64
	srv := httptest.NewServer(queryParsedInFront(idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		_, _ = io.WriteString(w, "captured")
	}))))
	t.Cleanup(srv.Close)
	for i, c := range []struct{ ct, body string }{
		{"", ""},
		{"application/json", ""},
		// A multipart body ParseMultipartForm fails on, read whole by it.
		{"multipart/form-data; boundary=X", "--X\r\nbad"},
	} {
		key := fmt.Sprintf("k-empty-%d", i)
		first := mountedPost(t, srv.URL+"/capture", c.ct, c.body)
		first.Header.Set("X-Skip", "1")
		require.Equal(t, "captured", do(t, srv.Client(), first, key).body)
		retry := do(t, srv.Client(), mountedPost(t, srv.URL+"/capture", c.ct, c.body), key)
		if !assert.Equal(t, http.StatusOK, retry.status, "Content-Type %q: the retry of the same POST, parsed in front: %s", c.ct, retry.body) {
			continue
		}
		assert.Equal(t, "true", retry.header.Get(idempotency.ReplayedHeader))
	}
}

// It failed when a chunked form parsed in front was held to the limit by
// a guess of its size (r.PostForm.Encode()) and an unparsed one by its
// bytes: "%41" (3 bytes) re-encodes as "A", pairs url.ParseQuery drops
// count for nothing, "é" (2 bytes) re-encodes as "%C3%A9" (6), so bodies
// over the limit were served parsed in front and bodies under it refused.
// A form sent without a length is held to the limit by the size of its
// encoded fields either way: one answer, and a replay for the retry.
func TestHTTPChunkedFormGetsOneAnswerWhetherOrNotParsedInFront(t *testing.T) {
	t.Parallel()
	store := migratedStore(t, suiteDB(t))
	var runs atomic.Int64
	srv := httptest.NewServer(csrfInFront(idempotency.HTTPMiddleware(store, idempotency.WithHTTPMaxRequestBytes(1000))(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		_, _ = fmt.Fprintf(w, "note of %d bytes", len(r.PostFormValue("note")))
	}))))
	t.Cleanup(srv.Close)
	const form = "application/x-www-form-urlencoded"
	served := 0
	for i, body := range []string{
		"csrf=ok&note=" + strings.Repeat("%41", 500),    // 1513 bytes, 513 encoded
		"csrf=ok&note=a&" + strings.Repeat("x;y&", 400), // 1615 bytes, 15 encoded
		"csrf=ok&note=" + strings.Repeat("é", 250),      // 513 bytes, 1513 encoded
		"csrf=ok&note=" + strings.Repeat("b", 2000),     // over either way
	} {
		key := fmt.Sprintf("k-chunked-%d", i)
		unparsed := chunked(mountedPost(t, srv.URL, form, body))
		unparsed.Header.Set("X-CSRF-Token", "ok")
		first := do(t, srv.Client(), unparsed, key)
		parsed := do(t, srv.Client(), chunked(mountedPost(t, srv.URL, form, body)), key)
		require.Equal(t, first.status, parsed.status, "body %d: one answer, parsed in front or not: %s / %s", i, first.body, parsed.body)
		require.Equal(t, first.body, parsed.body, "body %d", i)
		if first.status == http.StatusOK {
			served++
			require.Equal(t, "true", parsed.header.Get(idempotency.ReplayedHeader), "body %d: the retry is replayed", i)
		} else {
			require.Equal(t, http.StatusRequestEntityTooLarge, first.status, "body %d", i)
		}
	}
	require.EqualValues(t, served, runs.Load(), "one run per served body")
	require.Equal(t, 2, served, "the first two are within the limit by their fields, the last two are not")
}

// It failed because a form over ParseForm's own 10 MB cap, parsed in
// front, is read only up to the cap (ParseForm fails, r.PostForm empty):
// the rest is what the middleware reads and holds to the limit, so a body
// over WithHTTPMaxRequestBytes is served (the handler runs on the tail of
// the body) instead of getting 413 as it does unparsed.
func TestHTTPFormOverParseFormsCapParsedInFrontGets413(t *testing.T) {
	t.Parallel()
	store := migratedStore(t, suiteDB(t))
	var runs atomic.Int64
	const limit = 10<<20 + 1000
	srv := httptest.NewServer(queryParsedInFront(idempotency.HTTPMiddleware(store, idempotency.WithHTTPMaxRequestBytes(limit))(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		b, _ := io.ReadAll(r.Body)
		_, _ = fmt.Fprintf(w, "read %d bytes", len(b))
	}))))
	t.Cleanup(srv.Close)
	body := "note=" + strings.Repeat("a", 10<<20+2000)
	unparsed := mountedPost(t, srv.URL, "application/x-www-form-urlencoded", body)
	unparsed.Header.Set("X-Skip", "1")
	require.Equal(t, http.StatusRequestEntityTooLarge, do(t, srv.Client(), unparsed, "k-cap-a").status, "sanity: unparsed")
	parsed := do(t, srv.Client(), mountedPost(t, srv.URL, "application/x-www-form-urlencoded", body), "k-cap-b")
	require.Equal(t, http.StatusRequestEntityTooLarge, parsed.status, "a %d-byte body over the %d-byte limit, parsed in front: %s", len(body), limit, parsed.body)
	require.Zero(t, runs.Load())
}

// It failed because two bodies are compared by their bytes alone when both
// were read: the same bytes sent as a form and as text/plain share a
// stored response, though a form handler reads a field from one and
// nothing from the other (and a multipart body's fields depend on the
// boundary its Content-Type names).
func TestHTTPSameBytesUnderAnotherContentTypeIsNotAReplay(t *testing.T) {
	t.Parallel()
	store := migratedStore(t, suiteDB(t))
	var runs atomic.Int64
	srv := httptest.NewServer(idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		if a := r.PostFormValue("amount"); a != "" {
			_, _ = fmt.Fprintf(w, "charged %s", a)
			return
		}
		_, _ = io.WriteString(w, "nothing charged")
	})))
	t.Cleanup(srv.Close)
	first := do(t, srv.Client(), mountedPost(t, srv.URL, "text/plain", "amount=100"), "k-ctype")
	require.Equal(t, "nothing charged", first.body)
	other := do(t, srv.Client(), mountedPost(t, srv.URL, "application/x-www-form-urlencoded", "amount=100"), "k-ctype")
	require.Empty(t, other.header.Get(idempotency.ReplayedHeader), "a form got the stored response of the same bytes as text/plain: %s", other.body)
	require.NotEqual(t, "nothing charged", other.body)
}

// It failed because a stored version 4 fingerprint that does not parse
// (its flags byte not one the format knows, its length not the flags')
// is taken for an untagged one, so against any valid version 4
// fingerprint it is "not comparable" and counts as the same request: a
// different body under the key gets the stored response.
func TestHTTPMalformedStoredFingerprintIsNotTheSameRequest(t *testing.T) {
	t.Parallel()
	db := suiteDB(t)
	store := migratedStore(t, db)
	var runs atomic.Int64
	srv := httptest.NewServer(idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		b, _ := io.ReadAll(r.Body)
		_, _ = fmt.Fprintf(w, "charged %s", b)
	})))
	t.Cleanup(srv.Close)
	for i, corrupt := range []string{
		`set_byte(fingerprint, 37, 7)`,         // unknown flag
		`substring(fingerprint from 1 for 50)`, // truncated
		`fingerprint || '\x00'::bytea`,         // a byte too many
	} {
		key := fmt.Sprintf("k-corrupt-%d", i)
		require.Equal(t, "charged 100", do(t, srv.Client(), mountedPost(t, srv.URL, "application/json", "100"), key).body)
		tag, err := db.Pool.Exec(context.Background(), `UPDATE idempotency_keys SET fingerprint = `+corrupt+` WHERE key LIKE '%'||$1`, key)
		require.NoError(t, err)
		require.EqualValues(t, 1, tag.RowsAffected())
		other := do(t, srv.Client(), mountedPost(t, srv.URL, "application/json", "999"), key)
		assert.Empty(t, other.header.Get(idempotency.ReplayedHeader), "corruption %q: another body got the stored response: %s", corrupt, other.body)
	}
}

// csrfInFront parses the form only when the token header is missing, as
// gorilla/csrf does (r.PostFormValue, its error ignored): one attempt of a
// request is parsed in front, its retry with the header is not.
func csrfInFront(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		token := r.Header.Get("X-CSRF-Token")
		if token == "" {
			token = r.PostFormValue("csrf")
		}
		if token != "ok" {
			http.Error(w, "csrf", http.StatusForbidden)
			return
		}
		next.ServeHTTP(w, r)
	})
}

// It failed when a form-typed body was identified by its fields alone:
// curl -d sends JSON as application/x-www-form-urlencoded, a JSON handler
// reads the bytes, and {"note":"a b"} got the stored response of
// {"note":"a+b"} (url.ParseQuery reads "+" as a space). Bodies read by the
// middleware are compared by their bytes.
func TestHTTPJSONSentWithTheFormTypeIsNotAnotherRequestsReplay(t *testing.T) {
	t.Parallel()
	store := migratedStore(t, suiteDB(t))
	var runs atomic.Int64
	srv := httptest.NewServer(idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		var in struct{ Note string }
		if err := json.NewDecoder(r.Body).Decode(&in); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		_, _ = fmt.Fprintf(w, "note %q", in.Note)
	})))
	t.Cleanup(srv.Close)
	const curlType = "application/x-www-form-urlencoded"

	first := do(t, srv.Client(), mountedPost(t, srv.URL, curlType, `{"note":"a+b"}`), "k-json-as-form")
	require.Equal(t, `note "a+b"`, first.body)
	other := do(t, srv.Client(), mountedPost(t, srv.URL, curlType, `{"note":"a b"}`), "k-json-as-form")
	require.Empty(t, other.header.Get(idempotency.ReplayedHeader), "another body got the first's stored response: %s", other.body)
	require.Equal(t, http.StatusUnprocessableEntity, other.status, "another body under the same key: %s", other.body)
	require.EqualValues(t, 1, runs.Load())
}

// It failed when WithHTTPMaxRequestBytes held only the bytes left to
// read: a form over the limit parsed in front ran and was stored, and its
// retry, not parsed in front, got 413. One key, two answers.
func TestHTTPFormOverTheLimitGetsOneAnswerWhetherOrNotParsedInFront(t *testing.T) {
	t.Parallel()
	store := migratedStore(t, suiteDB(t))
	var runs atomic.Int64
	srv := httptest.NewServer(csrfInFront(idempotency.HTTPMiddleware(store, idempotency.WithHTTPMaxRequestBytes(1024))(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		_, _ = fmt.Fprintf(w, "charged %s", r.PostFormValue("amount"))
	}))))
	t.Cleanup(srv.Close)
	const form = "application/x-www-form-urlencoded"
	body := "csrf=ok&amount=100&memo=" + strings.Repeat("x", 4096)

	first := do(t, srv.Client(), mountedPost(t, srv.URL, form, body), "k-over-limit")
	retry := mountedPost(t, srv.URL, form, body)
	retry.Header.Set("X-CSRF-Token", "ok")
	r := do(t, srv.Client(), retry, "k-over-limit")
	require.Equal(t, first.status, r.status, "first %d %q, retry %d %q", first.status, first.body, r.status, r.body)
	require.Equal(t, first.body, r.body)
}

// It failed when a form with no fields ("&") parsed in front was taken
// for an empty body: the retry of the same body, parsed in front once and
// not the other time, got 422.
func TestHTTPEmptyFormRetryIsTheSameRequestWhetherOrNotParsedInFront(t *testing.T) {
	t.Parallel()
	store := migratedStore(t, suiteDB(t))
	var runs atomic.Int64
	parseSometimes := func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.Header.Get("X-Parse") != "" {
				_ = r.ParseForm()
			}
			next.ServeHTTP(w, r)
		})
	}
	srv := httptest.NewServer(parseSometimes(idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		_, _ = fmt.Fprintf(w, "fields %d", len(r.PostForm))
	}))))
	t.Cleanup(srv.Close)
	const form = "application/x-www-form-urlencoded"

	first := mountedPost(t, srv.URL, form, "&")
	first.Header.Set("X-Parse", "1")
	require.Equal(t, http.StatusOK, do(t, srv.Client(), first, "k-empty-form").status)
	r := do(t, srv.Client(), mountedPost(t, srv.URL, form, "&"), "k-empty-form")
	require.Equal(t, http.StatusOK, r.status, "the same body under the same key: %s", r.body)
	require.Equal(t, "true", r.header.Get(idempotency.ReplayedHeader))
	require.EqualValues(t, 1, runs.Load())
}

// A form sent twice under one key, parsed in front by a CSRF middleware
// (csrfInFront) on the first attempt and not on its retry, is one
// request: it runs once and the retry gets its answer replayed. Each case
// failed once:
//   - a form was fingerprinted from its fields when a middleware in front
//     parsed it and from its bytes when none did: a CSRF check that reads
//     a header and falls back to the form (gorilla/csrf's order) parsed
//     one attempt and not its retry, which got 422 for the very same body.
//     A form is identified by its fields either way;
//   - a form url.ParseQuery refuses ("50%off") was identified by its bytes
//     unread and by the pairs net/http kept when parsed in front: the
//     retry of the same body, parsed in front once, got 422;
//   - a Content-Type with a malformed parameter ("; charset") was not a
//     form's to the middleware while net/http parses it as one: parsed in
//     front once and not on the retry, the same request got 422;
//   - the multipart boundary was taken out of the Content-Type's
//     parameters before the middleware parsed the body with it: every
//     multipart body the middleware read had the form of one that does
//     not parse, so a multipart form parsed in front on one attempt and
//     not on its retry got 422.
func TestHTTPFormRetryIsTheSameRequestWhetherOrNotParsedInFront(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ name, contentType, body string }{
		{"url-encoded form", "application/x-www-form-urlencoded", "csrf=ok&amount=100"},
		{"form url.ParseQuery refuses", "application/x-www-form-urlencoded", "csrf=ok&amount=100&memo=50%off"},
		{"form type with a malformed parameter", "application/x-www-form-urlencoded; charset", "csrf=ok&amount=100"},
		{"multipart form", "multipart/form-data; boundary=b0undary", strings.Join([]string{
			"--b0undary", `Content-Disposition: form-data; name="csrf"`, "", "ok",
			"--b0undary", `Content-Disposition: form-data; name="amount"`, "", "100",
			"--b0undary--", "",
		}, "\r\n")},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			requireOneChargeWhetherParsedInFront(t, c.contentType, c.body)
		})
	}
}

// requireOneChargeWhetherParsedInFront sends a charge of the form body
// twice under one key, parsed in front by csrfInFront the first time and
// not the second (its retry carries the CSRF header), and requires one run
// whose answer, "charged 100", the retry gets replayed.
func requireOneChargeWhetherParsedInFront(t *testing.T, contentType, body string) {
	t.Helper()
	store := migratedStore(t, suiteDB(t))
	var runs atomic.Int64
	srv := httptest.NewServer(csrfInFront(idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		_, _ = fmt.Fprintf(w, "charged %s", r.PostFormValue("amount"))
	}))))
	t.Cleanup(srv.Close)
	first := do(t, srv.Client(), mountedPost(t, srv.URL, contentType, body), "k-charge")
	require.Equal(t, "charged 100", first.body)
	retry := mountedPost(t, srv.URL, contentType, body)
	retry.Header.Set("X-CSRF-Token", "ok")
	r := do(t, srv.Client(), retry, "k-charge")
	require.Equal(t, http.StatusOK, r.status, "the same request under the same key: %s", r.body)
	require.Equal(t, "charged 100", r.body)
	require.Equal(t, "true", r.header.Get(idempotency.ReplayedHeader))
	require.EqualValues(t, 1, runs.Load())
}

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

// It failed when the fingerprint covered only the body bytes left to
// read: a CSRF middleware in front that parsed the form consumed them, and
// amount=999 under the key of amount=100 was answered "charged 100",
// replayed. A parsed multipart form's files count too.
func TestHTTPFormParsedInFrontIsFingerprinted(t *testing.T) {
	t.Parallel()
	store := migratedStore(t, suiteDB(t))
	var runs atomic.Int64
	csrf := func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if strings.HasPrefix(r.Header.Get("Content-Type"), "multipart/") {
				require.NoError(t, r.ParseMultipartForm(1<<20))
			}
			if r.PostFormValue("csrf") != "ok" {
				http.Error(w, "csrf", http.StatusForbidden)
				return
			}
			next.ServeHTTP(w, r)
		})
	}
	handler := idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		note := ""
		if r.MultipartForm != nil {
			f, _, err := r.FormFile("receipt")
			require.NoError(t, err)
			b, _ := io.ReadAll(f)
			note = " with " + string(b)
		}
		_, _ = fmt.Fprintf(w, "charged %s%s", r.PostFormValue("amount"), note)
	}))
	srv := httptest.NewServer(csrf(handler))
	t.Cleanup(srv.Close)
	const form = "application/x-www-form-urlencoded"

	first := do(t, srv.Client(), mountedPost(t, srv.URL, form, "csrf=ok&amount=100"), "k-form")
	require.Equal(t, "charged 100", first.body)
	other := do(t, srv.Client(), mountedPost(t, srv.URL, form, "csrf=ok&amount=999"), "k-form")
	require.Equal(t, http.StatusUnprocessableEntity, other.status, "another form under the same key: %s", other.body)
	retry := do(t, srv.Client(), mountedPost(t, srv.URL, form, "csrf=ok&amount=100"), "k-form")
	require.Equal(t, "charged 100", retry.body)
	require.Equal(t, "true", retry.header.Get(idempotency.ReplayedHeader))

	multi := func(receipt string) *http.Request {
		var buf bytes.Buffer
		mw := multipart.NewWriter(&buf)
		require.NoError(t, mw.WriteField("csrf", "ok"))
		require.NoError(t, mw.WriteField("amount", "100"))
		h := textproto.MIMEHeader{}
		h.Set("Content-Disposition", `form-data; name="receipt"; filename="r.txt"`)
		h.Set("Content-Type", "text/plain")
		fw, err := mw.CreatePart(h)
		require.NoError(t, err)
		_, _ = io.WriteString(fw, receipt)
		require.NoError(t, mw.Close())
		return mountedPost(t, srv.URL, mw.FormDataContentType(), buf.String())
	}
	require.Equal(t, "charged 100 with receipt-1", do(t, srv.Client(), multi("receipt-1"), "k-multi").body)
	require.Equal(t, http.StatusUnprocessableEntity, do(t, srv.Client(), multi("receipt-2"), "k-multi").status, "another file under the same key")
	require.Equal(t, "true", do(t, srv.Client(), multi("receipt-1"), "k-multi").header.Get(idempotency.ReplayedHeader))
	require.EqualValues(t, 2, runs.Load())
}

// A key stored by the release before the host and a form's fields were
// part of an HTTP request's fingerprint: its retry after the upgrade
// replays the stored response (fingerprints of another schema are not
// compared, as across any deploy that changes one), never runs again and
// never gets 422.
func TestHTTPRetryAcrossTheFingerprintUpgradeReplays(t *testing.T) {
	t.Parallel()
	e := newHTTPEnv(t, nil)
	first := e.post("k-upgrade", "charge")
	require.Equal(t, http.StatusCreated, first.status)
	old := idempotency.PreviousHTTPFingerprint("POST /v1/charges", "/v1/charges", []byte("charge"))
	tag, err := e.db.Pool.Exec(context.Background(), `UPDATE idempotency_keys SET fingerprint = $1 WHERE key LIKE '%k-upgrade'`, old)
	require.NoError(t, err)
	require.EqualValues(t, 1, tag.RowsAffected())
	retry := e.post("k-upgrade", "charge")
	require.Equal(t, first.body, retry.body)
	require.Equal(t, "true", retry.header.Get(idempotency.ReplayedHeader))
	require.EqualValues(t, 1, e.runs.Load())
	require.Equal(t, 1, e.ledgerRows())
}

// A row the release before stored (HTTP fingerprint version 4: the body's
// digest of its raw bytes). It failed when no version 5 fingerprint was
// compared with it: a request with another body under its key got the
// stored response of the first (an order of 999 answered with the receipt
// of 100), for the key's whole TTL after the upgrade. Version 5 keeps the
// body's bytes digest beside its canonical JSON's: a byte-identical retry
// replays, another body is 422.
func TestHTTPVersionFourRowIsComparedAsBefore(t *testing.T) {
	t.Parallel()
	db := suiteDB(t)
	store := migratedStore(t, db)
	var runs atomic.Int64
	srv := httptest.NewServer(idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := runs.Add(1)
		w.WriteHeader(http.StatusCreated)
		_, _ = fmt.Fprintf(w, "run %d", n)
	})))
	t.Cleanup(srv.Close)
	first := `{"amount":100}`
	r1 := sendJSON(t, srv, "k-v4", "application/json", first)
	require.Equal(t, http.StatusCreated, r1.status, r1.body)

	// Make the stored row what version 4 stored for the same request.
	raw := sha256.Sum256([]byte(first))
	// Version 5's magic, version, request and flags (flag 4 cleared), then
	// the body's bytes digest: version 4's layout.
	tag, err := db.Pool.Exec(context.Background(), `UPDATE idempotency_keys SET fingerprint =
  set_byte(set_byte(substring(fingerprint from 1 for 38), 4, 4), 37, get_byte(fingerprint, 37) & 3) || $1::bytea
WHERE key = 'http k-v4'`, raw[:])
	require.NoError(t, err)
	require.EqualValues(t, 1, tag.RowsAffected())

	same := sendJSON(t, srv, "k-v4", "application/json", first)
	require.Equal(t, "true", same.header.Get(idempotency.ReplayedHeader), "the byte-identical retry replays")
	other := sendJSON(t, srv, "k-v4", "application/json", `{"amount":999}`)
	require.NotEqual(t, "true", other.header.Get(idempotency.ReplayedHeader), "another body got the stored response %q", other.body)
	require.Equal(t, http.StatusUnprocessableEntity, other.status)
	require.EqualValues(t, 1, runs.Load())
}
