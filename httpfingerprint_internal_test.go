package idempotency

import (
	"bytes"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// httpRequestFingerprint is the fingerprint the middleware takes of a POST
// of body under contentType to api.example/v1/charges; parsed: a
// middleware in front parsed its form first, reading the body.
func httpRequestFingerprint(t testing.TB, contentType, body string, parsed bool) []byte {
	t.Helper()
	r, err := http.NewRequest(http.MethodPost, "http://api.example/v1/charges", strings.NewReader(body))
	require.NoError(t, err)
	if contentType != "" {
		r.Header.Set("Content-Type", contentType)
	}
	if parsed {
		_ = r.ParseMultipartForm(1 << 20) // ParseForm for a form that is not multipart
	}
	rest, err := io.ReadAll(r.Body)
	require.NoError(t, err)
	fp, _, err := httpFingerprint(r, "/v1/charges", rest, 1<<20)
	require.NoError(t, err)
	return fp
}

// multipartOf is a multipart body of the fields (name, value) under
// boundary.
func multipartOf(boundary string, fields ...string) string {
	var b strings.Builder
	for i := 0; i+1 < len(fields); i += 2 {
		fmt.Fprintf(&b, "--%s\r\nContent-Disposition: form-data; name=%q\r\n\r\n%s\r\n", boundary, fields[i], fields[i+1])
	}
	fmt.Fprintf(&b, "--%s--\r\n", boundary)
	return b.String()
}

// Derived keys follow the request comparison: every pair of requests it
// calls the same derives the same keys, and every pair it tells apart
// derives different ones, but two that are each the same request as a
// third: two bodies of one form, each the same request as that form
// parsed in front. (It failed for JSON written another way and for a form
// parsed in front on one side, whose keys hashed the body's bytes.)
func TestHTTPKeysFollowTheComparison(t *testing.T) {
	t.Parallel()
	const (
		jsonType = "application/json"
		formType = "application/x-www-form-urlencoded"
	)
	order := `{"account_id":"acct-1","amount_cents":250}`
	type request struct {
		contentType, body string
		parsed            bool
	}
	var requests []request
	add := func(contentType string, bodies ...string) {
		for _, b := range bodies {
			requests = append(requests, request{contentType, b, false})
			if strings.HasPrefix(contentType, "multipart/") || strings.HasPrefix(contentType, formType) {
				requests = append(requests, request{contentType, b, true})
			}
		}
	}
	jsons := []string{order, `{"amount_cents":250,"account_id":"acct-1"}`, "{ \"account_id\" : \"acct\\u002d1\",\n\"amount_cents\":250 }",
		`{"account_id":"acct-1","amount_cents":251}`, `{"a":1,"A":2}`, `{"A":2,"a":1}`, `{"account_id":`, `{"account_id": `}
	add(jsonType, jsons...)
	add("application/json; charset=UTF-8", jsons...)
	add("application/json; charset=utf-8", order)
	add(`application/json; charset="utf-8"`, order)
	add("application/json; charset", order) // malformed: compared in lower case whole
	add("Application/JSON; Charset", order)
	add("application/problem+json", order)
	add("text/plain; charset=ISO-8859-1", order, "charge")
	add("text/plain; charset=iso-8859-1", order)
	add("", "charge", "charge ")
	add("application/octet-stream", "charge")
	add(formType, "a=1&b=2", "b=2&a=1", "a=1&b=3", "a=1+x", "a=1%20x", `{"note":"a+b"}`, `{"note":"a b"}`, "50%off", "&", "")
	add(formType+"; charset=UTF-8", "a=1&b=2")
	add(formType+"; charset=utf-8", "a=1&b=2", "b=2&a=1")
	for _, boundary := range []string{"b0undary", "another"} {
		add("multipart/form-data; boundary="+boundary,
			multipartOf(boundary, "a", "1", "b", "2"), multipartOf(boundary, "b", "2", "a", "1"), multipartOf(boundary, "a", "1", "b", "3"),
			"--"+boundary+"\r\nnot a part")
	}

	fps := make([][]byte, len(requests))
	for i, r := range requests {
		fps[i] = httpRequestFingerprint(t, r.contentType, r.body, r.parsed)
	}
	name := func(i int) string {
		return fmt.Sprintf("%q under %q (parsed in front: %v)", requests[i].body, requests[i].contentType, requests[i].parsed)
	}
	sameKeys, bridged := 0, 0
	for i := range fps {
		for j := range fps {
			same := sameRequest(fps[i], fps[j])
			require.Equal(t, same, sameRequest(fps[j], fps[i]), "%s and %s: the comparison is symmetric", name(i), name(j))
			keys := bytes.Equal(derivationInput(fps[i], 3), derivationInput(fps[j], 3))
			if same {
				require.True(t, keys, "%s and %s are one request, with other keys", name(i), name(j))
				sameKeys++
				continue
			}
			if !keys {
				continue
			}
			// The exception: each is the same request as a third.
			third := -1
			for k := range fps {
				if sameRequest(fps[i], fps[k]) && sameRequest(fps[k], fps[j]) {
					third = k
					break
				}
			}
			require.NotEqual(t, -1, third, "%s and %s are two requests, with the same keys", name(i), name(j))
			require.True(t, requests[third].parsed, "%s and %s are one request with %s", name(i), name(j), name(third))
			bridged++
		}
	}
	t.Logf("%d requests: %d pairs with one identity, %d of them through a form parsed in front", len(fps), sameKeys, bridged)
	require.Positive(t, bridged, "sanity: the exception is exercised")

	for _, c := range []struct {
		name       string
		a, b       request
		same, keys bool
	}{
		{"JSON written another way", request{jsonType, order, false}, request{jsonType, jsons[1], false}, true, true},
		{"another JSON value", request{jsonType, order, false}, request{jsonType, jsons[3], false}, false, false},
		{"a charset in another case", request{"application/json; charset=UTF-8", order, false}, request{"application/json; charset=utf-8", order, false}, true, true},
		{"a form parsed in front or not", request{formType, "a=1&b=2", true}, request{formType, "a=1&b=2", false}, true, true},
		{"a form in another order, parsed in front", request{formType, "a=1&b=2", true}, request{formType, "b=2&a=1", false}, true, true},
		{"a form in another order, unparsed", request{formType, "a=1&b=2", false}, request{formType, "b=2&a=1", false}, false, true},
		{"JSON sent as a form", request{formType, `{"note":"a+b"}`, false}, request{formType, `{"note":"a b"}`, false}, false, true},
		{"a multipart form under another boundary", request{"multipart/form-data; boundary=b0undary", multipartOf("b0undary", "a", "1"), false},
			request{"multipart/form-data; boundary=another", multipartOf("another", "a", "1"), true}, true, true},
		{"another form", request{formType, "a=1&b=2", true}, request{formType, "a=1&b=3", false}, false, false},
	} {
		a := httpRequestFingerprint(t, c.a.contentType, c.a.body, c.a.parsed)
		b := httpRequestFingerprint(t, c.b.contentType, c.b.body, c.b.parsed)
		require.Equal(t, c.same, sameRequest(a, b), "%s: the same request", c.name)
		require.Equal(t, c.keys, bytes.Equal(derivationInput(a, 3), derivationInput(b, 3)), "%s: the same keys", c.name)
	}
}

// The keys of the release before: under version 3, a request whose
// version 5 fingerprint held nothing the comparison ignores (a body
// compared by its bytes, a form parsed in front) derives the keys it
// derived from that fingerprint whole; under version 2, every request
// does. The fingerprints are those that release computed.
func TestHTTPKeysOfTheReleaseBefore(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name, contentType, body string
		parsed                  bool
		version5                string
		kept                    bool // under version 3
	}{
		{"a body compared by its bytes", "application/octet-stream", "charge", false,
			"ff494446058916ce06c2853c426ec27173819f05aef4155b9f2cc636e846d8fb5d121ccd1e0297488fbab3282166738a47c2f619037228568494475d4ac107c46c02678cb728", true},
		{"a form parsed in front", "application/x-www-form-urlencoded", "b=2&a=1", true,
			"ff4944460567868fb3521f05814fc22b51f735e0ab8be7a4f27c6021402b432103fb3ef1bc01ec1495da157c8ae4800d6e6dfd5bab599ac66b4a190078a95a4d26c8652f249b", true},
		{"a form the middleware read", "application/x-www-form-urlencoded", "b=2&a=1", false,
			"ff4944460567868fb3521f05814fc22b51f735e0ab8be7a4f27c6021402b432103fb3ef1bc03ec1495da157c8ae4800d6e6dfd5bab599ac66b4a190078a95a4d26c8652f249ba746b90cddac3e075db2f0c7b65aa5d09a354bef1562352d9dab3156d1142834", false},
		{"JSON", "application/json", `{"amount_cents":100,"account_id":"acct-7"}`, false,
			"ff49444605ed4c5e8ba19b543c833ba1cc0dfcb55eeaa1f65202eaa78496fd471671267de0063e2a43c3f59b793cd3e8f672128d4f1148c0906ab9bd6f9af2bf0921c4990ee858f931c14918ad1a7045af83f56e3ec5d21a431029bb35ee68f3f8411188bfc0", false},
		{"JSON under a charset in upper case", "application/json; charset=UTF-8", `{"amount_cents":100,"account_id":"acct-7"}`, false,
			"ff49444605605f82a04ba0b0da5b4b8faf2a2081a4bc67dab1cf7a7ee4d1825ebac92f35c7063e2a43c3f59b793cd3e8f672128d4f1148c0906ab9bd6f9af2bf0921c4990ee858f931c14918ad1a7045af83f56e3ec5d21a431029bb35ee68f3f8411188bfc0", false},
		{"a multipart form parsed in front", "multipart/form-data; boundary=b0undary", multipartOf("b0undary", "amount_cents", "250"), true,
			"ff49444605b1dc70401cc20721917dfd53cf376adcac4521d9dff12194b478b464e5d96627019dd9a20c96fff2252999b532e24643ae8b08fe33b5d1aa6fc01ed023e2cd7a02", true},
		// That release dropped the boundary before it parsed the body: it
		// gave every multipart body it read the digest of a form that does
		// not parse.
		{"a multipart form the middleware read", "multipart/form-data; boundary=b0undary", multipartOf("b0undary", "amount_cents", "250"), false,
			"ff49444605b1dc70401cc20721917dfd53cf376adcac4521d9dff12194b478b464e5d966270357506ae0f8f6297daccd13e99f97907a3bf2992463aa2bba7e962ecbb614bae7fd9e2a0335940a270375d31bd6750f9c901d1a6a66e296c0be2ac0c568cac7b0", false},
	} {
		fp := httpRequestFingerprint(t, c.contentType, c.body, c.parsed)
		old, err := hex.DecodeString(c.version5)
		require.NoError(t, err)
		require.True(t, sameRequest(old, fp), "%s: the row of the release before is the same request", c.name)
		require.Equal(t, old, derivationInput(fp, 2), "%s: version 2 derives from the fingerprint as the release before stored it", c.name)
		require.Equal(t, c.kept, bytes.Equal(old, derivationInput(fp, 3)), "%s: version 3 keeps the keys of the release before", c.name)
	}
}

// FuzzHTTPKeysFollowTheComparison checks, for two bodies under one
// Content-Type, each parsed in front or not, that the comparison calling
// them the same gives them one identity, and that one identity for two
// requests it tells apart is one form's.
func FuzzHTTPKeysFollowTheComparison(f *testing.F) {
	types := []string{"application/json", "application/json; charset=UTF-8", "application/x-www-form-urlencoded",
		"multipart/form-data; boundary=b0undary", "text/plain", "application/merge-patch+json"}
	for i, s := range [][2]string{
		{`{"a":1,"b":[1,2]}`, `{"b":[1,2],"a":1}`}, {`{"a":1}`, `{"a":2}`}, {"a=1&b=2", "b=2&a=1"}, {"a=1+x", "a=1%20x"},
		{multipartOf("b0undary", "a", "1"), multipartOf("b0undary", "a", "1") + "\r\n"}, {"x", "x"}, {`{"a":1,"A":2}`, `{"A":2,"a":1}`},
	} {
		f.Add(uint8(i), s[0], s[1], i%2 == 0, false)
	}
	f.Fuzz(func(t *testing.T, typ uint8, a, b string, parsedA, parsedB bool) {
		contentType := types[int(typ)%len(types)]
		fa := httpRequestFingerprint(t, contentType, a, parsedA)
		fb := httpRequestFingerprint(t, contentType, b, parsedB)
		ia, ib := derivationInput(fa, 3), derivationInput(fb, 3)
		same, keys := sameRequest(fa, fb), bytes.Equal(ia, ib)
		if same && !keys {
			t.Fatalf("%q and %q under %q are one request, with other keys", a, b, contentType)
		}
		if keys && !same {
			pa, _ := readHTTP(fa)
			pb, _ := readHTTP(fb)
			if pa.form == nil || !bytes.Equal(pa.form, pb.form) {
				t.Fatalf("%q and %q under %q are two requests, with the same keys", a, b, contentType)
			}
		}
	})
}
