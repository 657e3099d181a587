package idempotency_test

import (
	"context"
	"encoding/hex"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/idempotency"
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

// It failed because the multipart boundary was taken out of the
// Content-Type's parameters before the middleware parsed the body with
// it: every multipart body the middleware read had the form of one that
// does not parse, so a multipart form parsed in front on one attempt (a
// CSRF middleware) and not on its retry got 422.
func TestHTTPMultipartFormRetryIsTheSameRequestWhetherOrNotParsedInFront(t *testing.T) {
	t.Parallel()
	body := strings.Join([]string{
		"--b0undary", `Content-Disposition: form-data; name="csrf"`, "", "ok",
		"--b0undary", `Content-Disposition: form-data; name="amount"`, "", "100",
		"--b0undary--", "",
	}, "\r\n")
	requireOneChargeWhetherParsedInFront(t, "multipart/form-data; boundary=b0undary", body)
}

// A JSON body under a charset other than UTF-8 is compared by its bytes:
// read in ISO-8859-1, the bytes C3 A9 are "Ã©", not the "é" that "\u00e9"
// is. RFC 9110 reads a Content-Type's charset where Go's mime package
// refuses the whole list of parameters (an empty parameter, which RFC
// 9110 allows), and so does a handler that reads it so.
func TestHTTPJSONUnderAnotherCharsetIsComparedByItsBytes(t *testing.T) {
	t.Parallel()
	srv, runs := jsonServer(t)
	for i, contentType := range []string{
		"application/json; charset=iso-8859-1",
		"application/json; charset=iso-8859-1;;",
		"application/json;; charset=iso-8859-1",
		"application/json; charset=iso-8859-1; ;",
	} {
		key := fmt.Sprintf("k-charset-%d", i)
		first := sendJSON(t, srv, key, contentType, "{\"note\":\"\xc3\xa9\"}")
		require.Equal(t, http.StatusCreated, first.status, "%s: %s", contentType, first.body)
		r := sendJSON(t, srv, key, contentType, `{"note":"\u00e9"}`)
		require.Equal(t, http.StatusUnprocessableEntity, r.status, "%s: another value in ISO-8859-1, replayed: %s", contentType, r.body)
		require.EqualValues(t, i+1, runs.Load(), "%s: one execution per key", contentType)
	}
}
