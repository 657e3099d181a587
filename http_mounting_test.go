package idempotency_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"mime/multipart"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"net/textproto"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/idempotency"
)

// The HTTP middleware mounted as services mount it: behind routers that
// rewrite the path, behind middleware that parses forms, with handlers
// that send trailers, informational responses and headers of their own
// spelling, on HTTP/1.1 and HTTP/2.

// mountedReply is what a client received, trailers included.
type mountedReply struct {
	status  int
	header  http.Header
	trailer http.Header
	body    string
}

// do sends req with the key and reads the whole response.
func do(t *testing.T, client *http.Client, req *http.Request, key string) mountedReply {
	t.Helper()
	if key != "" {
		req.Header.Set(idempotency.HeaderKey, key)
	}
	resp, err := client.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return mountedReply{resp.StatusCode, resp.Header, resp.Trailer, string(b)}
}

func mountedPost(t *testing.T, url, contentType, body string) *http.Request {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	require.NoError(t, err)
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	return req
}

// It failed when the method and fingerprint came from r.URL, which
// http.StripPrefix rewrites: tenant B's request got tenant A's stored
// response, and B's handler never ran. The same holds for routes that
// differ only in the host their mux pattern names.
func TestHTTPRoutesBehindStripPrefixAreDifferentCalls(t *testing.T) {
	t.Parallel()
	store := migratedStore(t, suiteDB(t))
	idem := idempotency.HTTPMiddleware(store)
	var runs atomic.Int64
	tenant := func(name string) http.Handler {
		return idem(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			runs.Add(1)
			_, _ = io.WriteString(w, "charged tenant "+name)
		}))
	}
	mux := http.NewServeMux()
	mux.Handle("/tenant-a/", http.StripPrefix("/tenant-a", tenant("A")))
	mux.Handle("/tenant-b/", http.StripPrefix("/tenant-b", tenant("B")))
	mux.Handle("POST a.example/charges", tenant("A"))
	mux.Handle("POST b.example/charges", tenant("B"))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)

	a := do(t, srv.Client(), mountedPost(t, srv.URL+"/tenant-a/charges", "", "100"), "k-1")
	require.Equal(t, http.StatusOK, a.status)
	require.Equal(t, "charged tenant A", a.body)
	b := do(t, srv.Client(), mountedPost(t, srv.URL+"/tenant-b/charges", "", "100"), "k-1")
	require.Equal(t, http.StatusUnprocessableEntity, b.status, "tenant B's route is another request: %s", b.body)
	require.Empty(t, b.header.Get(idempotency.ReplayedHeader))
	again := do(t, srv.Client(), mountedPost(t, srv.URL+"/tenant-a/charges", "", "100"), "k-1")
	require.Equal(t, "charged tenant A", again.body)
	require.Equal(t, "true", again.header.Get(idempotency.ReplayedHeader))
	require.EqualValues(t, 1, runs.Load())

	hostA := mountedPost(t, srv.URL+"/charges", "", "100")
	hostA.Host = "a.example"
	require.Equal(t, "charged tenant A", do(t, srv.Client(), hostA, "k-2").body)
	hostB := mountedPost(t, srv.URL+"/charges", "", "100")
	hostB.Host = "b.example"
	require.Equal(t, http.StatusUnprocessableEntity, do(t, srv.Client(), hostB, "k-2").status, "the route of another host is another request")
	require.EqualValues(t, 2, runs.Load())
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

// It failed when trailers were kept with the headers: on HTTP/1.1 a
// trailer's value went out early as a header and no trailer arrived; on
// HTTP/2 the first response had it and the replay did not; trailers set
// with http.TrailerPrefix were dropped. Trailers are stored and replayed as
// headers are: those of the replayed list.
func TestHTTPTrailersAreSentAndReplayedAsTrailers(t *testing.T) {
	t.Parallel()
	store := migratedStore(t, suiteDB(t))
	var runs atomic.Int64
	handler := idempotency.HTTPMiddleware(store, idempotency.WithHTTPReplayedHeaders("X-Checksum", "X-Signature"))(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.Header().Set("Trailer", "X-Checksum, X-Timing")
		w.Header().Set("Content-Type", "text/plain")
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, "charged")
		w.Header().Set("X-Checksum", "sum-1")
		w.Header().Set("X-Timing", "12ms")
		w.Header().Set(http.TrailerPrefix+"X-Signature", "sig-1")
	}))
	for _, proto := range []string{"HTTP/1.1", "HTTP/2"} {
		t.Run(proto, func(t *testing.T) {
			srv := httptest.NewUnstartedServer(handler)
			if proto == "HTTP/2" {
				srv.EnableHTTP2 = true
				srv.StartTLS()
			} else {
				srv.Start()
			}
			t.Cleanup(srv.Close)
			key := "k-trailer-" + proto
			first := do(t, srv.Client(), mountedPost(t, srv.URL, "", "x"), key)
			require.Equal(t, http.StatusCreated, first.status)
			for _, name := range []string{"X-Checksum", "X-Timing", "X-Signature"} {
				require.Empty(t, first.header.Get(name), "%s went out as a header", name)
			}
			require.Equal(t, "sum-1", first.trailer.Get("X-Checksum"))
			require.Equal(t, "12ms", first.trailer.Get("X-Timing"))
			require.Equal(t, "sig-1", first.trailer.Get("X-Signature"))

			replay := do(t, srv.Client(), mountedPost(t, srv.URL, "", "x"), key)
			require.Equal(t, "true", replay.header.Get(idempotency.ReplayedHeader))
			require.Equal(t, "charged", replay.body)
			require.Equal(t, "sum-1", replay.trailer.Get("X-Checksum"))
			require.Equal(t, "sig-1", replay.trailer.Get("X-Signature"))
			require.Empty(t, replay.trailer.Get("X-Timing"), "not in the replayed list: the first response's alone")
			require.Empty(t, replay.header.Get("X-Checksum"))
		})
	}
	require.EqualValues(t, 2, runs.Load())
}

// It failed when the body read before the handler ran under the server's
// ReadTimeout alone: a handler that extended the read deadline for a slow
// upload did so too late, and the client got 400 "i/o timeout" for the
// server's own timeout. WithHTTPReadTimeout gives the read its time; a read
// that times out is 408.
func TestHTTPSlowUploadAndTheReadDeadline(t *testing.T) {
	t.Parallel()
	store := migratedStore(t, suiteDB(t))
	handler := func(w http.ResponseWriter, r *http.Request) {
		_ = http.NewResponseController(w).SetReadDeadline(time.Now().Add(time.Minute))
		b, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		_, _ = fmt.Fprintf(w, "got %d bytes", len(b))
	}
	serve := func(h http.Handler) *httptest.Server {
		srv := httptest.NewUnstartedServer(h)
		srv.Config.ReadTimeout = 300 * time.Millisecond
		srv.Start()
		t.Cleanup(srv.Close)
		return srv
	}
	slowPost := func(srv *httptest.Server, key string) mountedReply {
		pr, pw := io.Pipe()
		go func() {
			for range 8 {
				time.Sleep(100 * time.Millisecond)
				if _, err := pw.Write([]byte("0123456789")); err != nil {
					return
				}
			}
			_ = pw.Close()
		}()
		req, err := http.NewRequest(http.MethodPost, srv.URL, pr)
		require.NoError(t, err)
		req.ContentLength = 80
		return do(t, srv.Client(), req, key)
	}
	plain := serve(http.HandlerFunc(handler))
	require.Equal(t, http.StatusOK, slowPost(plain, "").status, "the handler alone takes the slow upload")

	given := serve(idempotency.HTTPMiddleware(store, idempotency.WithHTTPReadTimeout(time.Minute))(http.HandlerFunc(handler)))
	r := slowPost(given, "k-slow")
	require.Equal(t, http.StatusOK, r.status, r.body)
	require.Equal(t, "got 80 bytes", r.body)

	bare := serve(idempotency.HTTPMiddleware(store)(http.HandlerFunc(handler)))
	r = slowPost(bare, "k-slow-bare")
	require.Equal(t, http.StatusRequestTimeout, r.status, "the server's timeout is not the client's 400: %s", r.body)
	require.Contains(t, r.body, "WithHTTPReadTimeout")
}

// It failed when headers were stored and replayed by the names the handler
// used: one set as w.Header()["location"] went out with the first response
// and was missing from the replay.
func TestHTTPHeaderOfAnotherSpellingIsReplayed(t *testing.T) {
	t.Parallel()
	store := migratedStore(t, suiteDB(t))
	srv := httptest.NewServer(idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header()["location"] = []string{"/v1/charges/7"}
		w.Header()["content-type"] = []string{"application/json"}
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, `{"id":7}`)
	})))
	t.Cleanup(srv.Close)
	first := do(t, srv.Client(), mountedPost(t, srv.URL, "", "x"), "k-spelling")
	require.Equal(t, "/v1/charges/7", first.header.Get("Location"))
	replay := do(t, srv.Client(), mountedPost(t, srv.URL, "", "x"), "k-spelling")
	require.Equal(t, "true", replay.header.Get(idempotency.ReplayedHeader))
	require.Equal(t, "/v1/charges/7", replay.header.Get("Location"))
	require.Equal(t, "application/json", replay.header.Get("Content-Type"))
}

// It failed when the method stored with the key was "POST " and the path
// in full: a path of about 1,100 bytes got a 400 the handler would not
// give.
func TestHTTPLongPathIsServed(t *testing.T) {
	t.Parallel()
	store := migratedStore(t, suiteDB(t))
	var runs atomic.Int64
	mux := http.NewServeMux()
	mux.Handle("POST /v1/charges/", idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		runs.Add(1)
		w.WriteHeader(http.StatusCreated)
	})))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	long := srv.URL + "/v1/charges/" + strings.Repeat("p", 1100)
	require.Equal(t, http.StatusCreated, do(t, srv.Client(), mountedPost(t, long, "", "x"), "k-long").status)
	replay := do(t, srv.Client(), mountedPost(t, long, "", "x"), "k-long")
	require.Equal(t, http.StatusCreated, replay.status)
	require.Equal(t, "true", replay.header.Get(idempotency.ReplayedHeader))
	other := do(t, srv.Client(), mountedPost(t, long+"q", "", "x"), "k-long")
	require.Equal(t, http.StatusUnprocessableEntity, other.status, "another long path is another request")
	require.EqualValues(t, 1, runs.Load())
}

// It failed when the recorder kept 1xx responses to itself: a 103 Early
// Hints never reached the client, and WriteHeader(101) was stored and
// replayed as 200. A 1xx other than 101 goes out at once, unstored; 101 is
// a final status.
func TestHTTPInformationalResponses(t *testing.T) {
	t.Parallel()
	store := migratedStore(t, suiteDB(t))
	srv := httptest.NewServer(idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Link", "</style.css>; rel=preload")
		w.WriteHeader(http.StatusEarlyHints)
		w.WriteHeader(http.StatusCreated)
		_, _ = io.WriteString(w, "charged")
	})))
	t.Cleanup(srv.Close)
	hints := func() (got []int) {
		req := mountedPost(t, srv.URL, "", "x")
		req = req.WithContext(httptrace.WithClientTrace(req.Context(), &httptrace.ClientTrace{
			Got1xxResponse: func(code int, header textproto.MIMEHeader) error {
				got = append(got, code)
				require.Equal(t, "</style.css>; rel=preload", header.Get("Link"))
				return nil
			},
		}))
		r := do(t, srv.Client(), req, "k-hints")
		require.Equal(t, http.StatusCreated, r.status)
		require.Equal(t, "charged", r.body)
		return got
	}
	require.Equal(t, []int{http.StatusEarlyHints}, hints(), "the 103 reaches the client")
	require.Empty(t, hints(), "a replay has no 1xx: they are not stored")

	switching := idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusSwitchingProtocols)
	}))
	for _, replayed := range []string{"", "true"} {
		rec := httptest.NewRecorder()
		req := httptest.NewRequestWithContext(context.Background(), http.MethodPost, "/upgrade", strings.NewReader("x"))
		req.Header.Set(idempotency.HeaderKey, "k-101")
		switching.ServeHTTP(rec, req)
		require.Equal(t, http.StatusSwitchingProtocols, rec.Code, "101 is final, stored and replayed as such")
		require.Equal(t, replayed, rec.Header().Get(idempotency.ReplayedHeader))
	}
}

// It failed when the body was read before the scope was asked: a caller
// the scope refused cost a read of up to 1 MiB, and a client that sent
// "Expect: 100-continue" was told to send its body.
func TestHTTPScopeIsAskedBeforeTheBodyIsRead(t *testing.T) {
	t.Parallel()
	store := migratedStore(t, suiteDB(t))
	var read atomic.Int64
	counting := func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			r.Body = &countingBody{r.Body, &read}
			next.ServeHTTP(w, r)
		})
	}
	refuse := idempotency.WithHTTPScope(func(r *http.Request) (string, error) {
		return "", fmt.Errorf("no caller")
	})
	srv := httptest.NewServer(counting(idempotency.HTTPMiddleware(store, refuse)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		t.Error("the handler ran for a refused caller")
	}))))
	t.Cleanup(srv.Close)
	req := mountedPost(t, srv.URL, "", strings.Repeat("x", 64<<10))
	req.Header.Set("Expect", "100-continue")
	r := do(t, srv.Client(), req, "k-refused")
	require.Equal(t, http.StatusUnauthorized, r.status, r.body)
	require.Zero(t, read.Load(), "no byte of the body was read")
}

type countingBody struct {
	io.ReadCloser
	n *atomic.Int64
}

func (b *countingBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	b.n.Add(int64(n))
	return n, err
}

// It failed when the headers stored with an HTTP response had no bound
// (MaxStoredMetadata bounded gRPC's alone): a handler's 64 KiB Location was
// stored with every key. Over the bound the request fails with 500, its
// writes rolled back and nothing stored, as on the gRPC side.
func TestHTTPStoredHeadersAreBounded(t *testing.T) {
	t.Parallel()
	big := newHTTPEnv(t, func(w http.ResponseWriter, r *http.Request) {
		_, err := idempotency.MustTxFromContext(r.Context()).Exec(r.Context(), `INSERT INTO ledger (note, key) VALUES ('big', 'k-big')`)
		require.NoError(t, err)
		w.Header().Set("Location", "/v1/charges/"+strings.Repeat("l", idempotency.MaxStoredMetadata))
		w.WriteHeader(http.StatusCreated)
	})
	r := big.post("k-big", "x")
	require.Equal(t, http.StatusInternalServerError, r.status, r.body)
	require.Contains(t, r.body, "MaxStoredMetadata")
	require.Zero(t, big.db.Count(t, `SELECT count(*) FROM ledger WHERE key = 'k-big'`), "the writes rolled back")
	r = big.post("k-big", "x")
	require.Equal(t, http.StatusInternalServerError, r.status, "nothing was stored: the retry runs again")
	require.EqualValues(t, 2, big.runs.Load())
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
